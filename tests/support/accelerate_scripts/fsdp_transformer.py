"""A tiny transformers Llama (tied embeddings, built from a local config: nothing downloaded) trained
with FSDP through an Accelerator, for tests/unit/accelerate/test_accelerate_fsdp.py.

python fsdp_transformer.py --out DIR [--plugin JSON] [--door triax|accelerate] [--mixed-precision no]
                           [--save-at N --save DIR] [--resume DIR]
The plugin's keyword arguments come as JSON (none: the Accelerator's own choice, e.g. from the
FSDP_* environment `triax launch --config_file` sets). Writes DIR/rank_<r>.json (losses, FSDP
units, local shard sizes) and DIR/model/model.safetensors (save_model, or for Accelerate's door the
gathered full state dict). --door accelerate runs Hugging Face Accelerate itself: it does not use
FSDP on CPU processes on its own, so the script sets its state to FSDP before prepare.
"""

import argparse
import json
import os

import torch
from torch.utils.data import DataLoader


class Progress:
    """How many optimizer steps were taken: saved and loaded with the Accelerator's state."""

    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return LlamaForCausalLM(config)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plugin", default=None, help="FullyShardedDataParallelPlugin keyword arguments as JSON")
    parser.add_argument("--door", default="triax", choices=("triax", "accelerate"))
    parser.add_argument("--mixed-precision", default=None)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split among processes)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--others-on-meta", action="store_true",
                        help="processes other than 0 build the model on the meta device (no weights at all), "
                             "as cpu_ram_efficient_loading allows")
    args = parser.parse_args()

    if args.door == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    else:
        from triax.accelerate import Accelerator
        from triax.accelerate.utils import FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin(**json.loads(args.plugin)) if args.plugin else None
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=args.mixed_precision)
    if args.door == "accelerate":
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        if accelerator.state.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.state.mixed_precision)

    with torch.device("meta" if args.others_on_meta and accelerator.process_index > 0 else "cpu"):
        model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens = torch.randint(3, 64, (args.batch_size * args.steps, 16), generator=torch.Generator().manual_seed(1))
    data = DataLoader(tokens, batch_size=args.batch_size // accelerator.num_processes)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    if args.door == "accelerate":
        # Preparing the data loader re-reads the processes' type (MULTI_CPU) into Accelerate's
        # state; save_state and load_state must see FSDP again to use Accelerate's FSDP layout.
        accelerator.state.distributed_type = DistributedType.FSDP
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)
    # Accelerate's recipe for resuming mid-epoch (the loader is not shuffled: its order is fixed).
    batches = accelerator.skip_first_batches(data, progress.steps) if progress.steps else data

    losses = []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        progress.steps += 1
        if progress.steps == args.save_at:
            accelerator.save_state(args.save)

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    os.makedirs(args.out, exist_ok=True)
    record = {"losses": losses, "steps": progress.steps, "num_processes": accelerator.num_processes,
              "units": [name for name, module in model.named_modules() if isinstance(module, FSDPModule)],
              "local_elements": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                                    for p in model.parameters()),
              "elements": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(args.out, f"rank_{accelerator.process_index}.json"), "w") as handle:
        json.dump(record, handle)
    if args.door == "triax":
        accelerator.save_model(model, os.path.join(args.out, "model"))
    else:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if accelerator.is_main_process:
            os.makedirs(os.path.join(args.out, "model"))
            save_file({k: v.clone().contiguous() for k, v in state.items()},
                      os.path.join(args.out, "model", "model.safetensors"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
