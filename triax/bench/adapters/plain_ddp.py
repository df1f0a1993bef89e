"""The baseline: the step as a PyTorch user writes it by hand with DistributedDataParallel."""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from triax.bench.adapters import BETAS, GRAD_CLIP, LEARNING_RATE, WEIGHT_DECAY, StepSetup
from triax.bench.models import loss_of


def make_step(setup: StepSetup, communication_hook: Callable | None = None):
    model = setup.model.build().to(setup.device)
    if setup.world_size > 1:
        model = DistributedDataParallel(
            model, device_ids=[setup.device.index] if setup.device.type == "cuda" else None,
            bucket_cap_mb=setup.bucket_mb, gradient_as_bucket_view=True)
        if communication_hook is not None:
            model.register_comm_hook(None, communication_hook)
        elif setup.grad_compression != "none":
            # Registering a PyTorch comm hook is one call; triax's picks the hook by name.
            from triax.parallel.comm_hooks import register_compression

            register_compression(model, setup.grad_compression, setup.powersgd_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS,
                                  weight_decay=WEIGHT_DECAY)
    inputs, targets = setup.batch()
    autocast = setup.precision.uses_autocast

    def step() -> torch.Tensor:
        with torch.autocast(setup.device.type, dtype=setup.precision.compute_dtype, enabled=autocast):
            output = model(inputs)
        loss = loss_of(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
