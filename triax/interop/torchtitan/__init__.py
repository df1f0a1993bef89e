"""torchtitan's DCP checkpoint steps, read box by box through torch.distributed.checkpoint."""
