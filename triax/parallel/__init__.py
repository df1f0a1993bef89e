"""Parallelism applied from outside a plain model (docs/architecture.md): one file per technique.

    mesh.py                  layouts (pp x dp_replicate x dp_shard x tp), their checks, the DeviceMesh
    tensor_parallel.py       tensor + sequence parallel plan of the GPT (DTensor parallelize_module)
    activation_checkpoint.py full / selective recomputation
    compile.py               torch.compile per block
    fsdp.py                  fully_shard (FSDP2) and HSDP
    ddp.py                   DistributedDataParallel
    pipeline_parallel.py     stages and schedules (torch.distributed.pipelining)
    parallelize.py           applies the above in order: TP, checkpointing, compile, FSDP/DDP
    grad_clip.py             gradient clipping across meshes and stages
    plan.py                  `triax plan`: which layouts fit, by formula
"""

from triax.parallel.ddp import apply_ddp

__all__ = ["apply_ddp"]
