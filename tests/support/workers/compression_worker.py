"""Run under torchrun: train the same small model with each gradient compression and save, on
rank 0, the first step's averaged gradients, the final weights and the loss curve of each."""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from triax.parallel.ddp import apply_ddp
from triax.runtime.place import detect_place
from triax.runtime.process_group import init_distributed

STEPS = 30


def train(compression: str, rank: int) -> dict:
    torch.manual_seed(0)
    # 64x64 matrices: rank-2 PowerSGD factors are 16x smaller, so PowerSGD really compresses them.
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = apply_ddp(model, torch.device("cpu"), grad_compression=compression, powersgd_rank=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    inputs = torch.randn(256, 32, generator=generator)
    targets = torch.sin(inputs[:, :8] * 2) + inputs[:, 8:16] * inputs[:, 16:24]
    losses, first_grads = [], None
    for step in range(STEPS):
        batch = slice((step % 8) * 32, (step % 8 + 1) * 32)
        loss = nn.functional.mse_loss(ddp(inputs[batch]), targets[batch])
        loss.backward()
        if first_grads is None:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            full = nn.functional.mse_loss(model(inputs), targets)
        dist.all_reduce(full)
        losses.append(full.item() / dist.get_world_size())
    return {"grads": first_grads, "weights": {k: v.clone() for k, v in model.state_dict().items()},
            "losses": losses}


def main() -> None:
    place = init_distributed(torch.device("cpu"), detect_place())
    results = {name: train(name, place.rank) for name in ("none", "bf16", "fp16", "powersgd")}
    if place.rank == 0:
        torch.save(results, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
