"""One training step written several ways, one small file each.

Every adapter module has `make_step(setup) -> step`, where `step()` runs one full optimizer step
(forward, loss, backward, gradient clipping at norm 1.0, AdamW update, zero grads) on the fixed
synthetic batch and returns the loss. A way that cannot run here raises `Unavailable` with the reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from triax.bench.models import BenchModel
from triax.runtime.precision import Precision

# name -> module; the order is the order of the table.
ADAPTERS = {
    "ddp": "triax.bench.adapters.plain_ddp",  # the baseline every ratio is against
    "triax": "triax.bench.adapters.triax_trainer",
    "accelerator": "triax.bench.adapters.triax_accelerator",
    "horovod": "triax.bench.adapters.triax_horovod",
    "hf-accelerate": "triax.bench.adapters.hf_accelerate",
    # The hand-written loop with a hook that sends nothing: the step without communication.
    "ddp-no-comm": "triax.bench.adapters.no_communication",
}
BASELINE = "ddp"
NO_COMM = "ddp-no-comm"

LEARNING_RATE = 1e-4
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0


class Unavailable(Exception):
    """This way of writing the step cannot run here (module missing, not applicable)."""


@dataclass
class StepSetup:
    """What every adapter needs to build its step."""

    model: BenchModel
    device: torch.device
    precision: Precision
    batch_size: int  # per process
    rank: int
    world_size: int
    bucket_mb: float = 25.0
    grad_compression: str = "none"
    powersgd_rank: int = 2
    scratch_dir: str = "."  # where an adapter may write (the trainer's run directory)
    extra: dict = field(default_factory=dict)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.batch(self.rank, self.batch_size, self.device)


def make_step(name: str, setup: StepSetup):
    if name not in ADAPTERS:
        raise KeyError(name)
    module = importlib.import_module(ADAPTERS[name])
    return module.make_step(setup)
