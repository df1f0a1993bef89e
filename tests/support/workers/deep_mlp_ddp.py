"""A plain DDP script with several gradient buckets in flight per step (no triax in it): argv =
steps, width, layers. Every rank prints a checksum of its parameters at the end; DDP keeps the
replicas equal, so the checksums must agree. Started by tests/unit/bench/test_netns.py under
`python -m triax.ddp_boost` on a simulated slow network."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

steps, width, layers = (int(value) for value in sys.argv[1:4])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(1 + dist.get_rank())
for _ in range(steps):
    optimizer.zero_grad()
    model(torch.randn(32, width, generator=generator)).square().mean().backward()
    optimizer.step()
checksum = sum(float(parameter.double().sum()) for parameter in model.parameters())
print(f"rank {dist.get_rank()} checksum {checksum:.12e}", flush=True)
dist.destroy_process_group()
