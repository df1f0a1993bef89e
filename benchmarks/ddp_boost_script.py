"""The unchanged plain DDP script timed by benchmarks/ddp_boost_netns.py: argv = steps, width."""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

steps, width = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
torch.manual_seed(0)
layers = [torch.nn.Linear(width, width) for _ in range(4)]
model = DistributedDataParallel(torch.nn.Sequential(*layers))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
inputs = torch.randn(32, width)
WARMUP = 12  # PowerSGD compresses from step 10 on (comm_hooks.POWERSGD_START_STEP); time after that
for step in range(steps + WARMUP):
    if step == WARMUP:
        dist.barrier()
        began = time.perf_counter()
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()
dist.barrier()
if dist.get_rank() == 0:
    print(f"seconds per step {(time.perf_counter() - began) / steps:.4f}", flush=True)
dist.destroy_process_group()
