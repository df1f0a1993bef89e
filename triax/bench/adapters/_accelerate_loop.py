"""The step in HF Accelerate's style, shared by the triax.Accelerator and HF Accelerate adapters
(triax.Accelerator follows the same API: prepare, backward, clip_grad_norm_)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triax.bench.adapters import BETAS, GRAD_CLIP, LEARNING_RATE, WEIGHT_DECAY, StepSetup
from triax.bench.models import loss_of
from triax.launch.settings import accelerate_precision_name

if TYPE_CHECKING:
    from torch import nn

    from triax.accelerate.accelerator import Accelerator


def mixed_precision_name(setup: StepSetup) -> str:
    return accelerate_precision_name(setup.precision.name)


def accelerate_step(accelerator: Accelerator, setup: StepSetup):
    model = setup.model.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS,
                                  weight_decay=WEIGHT_DECAY)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs, targets = setup.batch()
    inputs, targets = inputs.to(accelerator.device), targets.to(accelerator.device)

    def step() -> torch.Tensor:
        # prepare() has wrapped forward in autocast for mixed precision.
        loss = loss_of(model(inputs), targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def ddp_kwargs_handlers(module: nn.Module, setup: StepSetup) -> list:
    """Bucket size through DistributedDataParallelKwargs, where the module has it."""
    kwargs_class = getattr(module, "DistributedDataParallelKwargs", None)
    if kwargs_class is None:
        return []
    try:
        return [kwargs_class(bucket_cap_mb=int(setup.bucket_mb), gradient_as_bucket_view=True)]
    except TypeError:  # an implementation without these fields: its defaults then
        return []
