"""A plain PyTorch DDP script, as a user writes it (no triax in it). Started under torchrun by
tests/unit/test_ddp_boost.py; rank 0 writes the trained parameters to argv[1] (safetensors).
With a second argument 'by-hand', it registers PyTorch's fp16 compression hook itself."""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
if sys.argv[2:] == ["by-hand"]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
generator = torch.Generator().manual_seed(1 + rank)
for _ in range(3):
    inputs = torch.randn(16, 8, generator=generator) / 3
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), inputs.sum(1, keepdim=True)).backward()
    optimizer.step()
if rank == 0:
    save_file({k: v.contiguous() for k, v in model.module.state_dict().items()}, sys.argv[1],
              metadata={"hooks": str(len(model._comm_hooks)), "bucket_cap_mb": str(model.bucket_bytes_cap / 2**20)})
dist.destroy_process_group()
# `python -m triax.ddp_boost` runs as __main__, so ask DDP whether the boost is installed.
if DistributedDataParallel.__init__.__name__ != "_boosted_init":
    # Without triax (the by-hand and plain reference runs) PyTorch's own collectives can leave
    # work for gloo's worker thread that needs the GIL after the script's last line, which aborts
    # the process if the interpreter is finalizing by then (seen with its Python fp16 hook, and
    # once with no hook at all). triax keeps its works until exit instead (triax/runtime/collectives_at_exit.py,
    # keep_until_exit): the boosted run must exit normally, and the test checks that it does.
    # The references' output is written and closed, so they skip finalization.
    sys.stdout.flush()
    os._exit(0)
