"""A small 1-D U-Net whose skip connections cross the partitions of a `Pipe` (triax.pipe.skip).

Each `Down` stashes its input; the matching `Up` pops it and adds it back. The same two classes are
used at two depths, so each pair is isolated in its own `Namespace`. With the default balance
[2, 3, 2] the outer skip travels from partition 0 to partition 2 (copied straight to partition 2's
device), the inner one stays inside partition 1. The task is denoising a sine wave (synthetic data,
no download). The script first checks the pipe against the same layers run as a plain
nn.Sequential, then trains.

    python examples/pipe_skip_unet.py                                  # three CPU partitions
    python examples/pipe_skip_unet.py --devices cuda:0 cuda:1 cuda:0   # GPUs
    python examples/pipe_skip_unet.py --chunks 2 --checkpoint always --steps 10
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from triax.pipe import Pipe
from triax.pipe.skip import Namespace, pop, skippable, stash

CHANNELS = 16
LENGTH = 32  # two halvings deep, so a multiple of 4


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stashes its input for the matching Up; returns features at half the length."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(CHANNELS, CHANNELS, 3, padding=1)

    def forward(self, x):
        yield stash("skip", x)
        return F.avg_pool1d(torch.relu(self.conv(x)), 2)


@skippable(pop=["skip"])
class Up(nn.Module):
    """Doubles the length back and adds what the matching Down stashed."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(CHANNELS, CHANNELS, 3, padding=1)

    def forward(self, x):
        skip = yield pop("skip")
        return torch.relu(self.conv(F.interpolate(x, scale_factor=2))) + skip


def unet() -> nn.Sequential:
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        nn.Conv1d(1, CHANNELS, 3, padding=1),
        Down().isolate(outer), Down().isolate(inner),
        nn.Conv1d(CHANNELS, CHANNELS, 3, padding=1),
        Up().isolate(inner), Up().isolate(outer),
        nn.Conv1d(CHANNELS, 1, 1),
    )


def noisy_sines(batch_size: int, generator: torch.Generator):
    """(noisy input, clean target): sines of random phase and frequency, plus Gaussian noise."""
    position = torch.arange(LENGTH) / LENGTH
    phase = torch.rand(batch_size, 1, 1, generator=generator) * 2 * math.pi
    frequency = 1 + torch.rand(batch_size, 1, 1, generator=generator) * 2
    clean = torch.sin(2 * math.pi * frequency * position + phase)
    return clean + 0.3 * torch.randn(clean.shape, generator=generator), clean


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu", "cpu"])
    parser.add_argument("--balance", nargs="+", type=int, default=[2, 3, 2])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    plain = unet()
    model = Pipe(copy.deepcopy(plain), balance=args.balance, devices=args.devices, chunks=args.chunks,
                 checkpoint=args.checkpoint)
    print(f"balance {model.balance} on {[str(d) for d in model.devices]}, chunks {model.chunks}, "
          f"checkpoint {model.checkpoint}")
    generator = torch.Generator().manual_seed(0)
    noisy, _ = noisy_sines(args.batch_size, generator)
    with torch.no_grad():
        difference = (model(noisy).cpu() - plain(noisy)).abs().max().item()
    print(f"pipe output vs the plain nn.Sequential: largest difference {difference:.1e}")

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        noisy, clean = noisy_sines(args.batch_size, generator)
        output = model(noisy)
        loss = F.mse_loss(output, clean.to(output.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
