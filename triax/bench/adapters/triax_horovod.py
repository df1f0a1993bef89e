"""The step through triax.horovod, written as a Horovod user writes it."""

from __future__ import annotations

import torch

from triax.bench.adapters import BETAS, GRAD_CLIP, LEARNING_RATE, WEIGHT_DECAY, StepSetup, Unavailable
from triax.bench.models import loss_of


def make_step(setup: StepSetup):
    # triax's own door: failing to import it is a bug to report as a failed row, never "not available".
    import triax.horovod as hvd

    if setup.grad_compression != "none":
        raise Unavailable("the bench times Horovod without compression")
    hvd.init()
    model = setup.model.build().to(setup.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS,
                                  weight_decay=WEIGHT_DECAY)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    inputs, targets = setup.batch()
    autocast = setup.precision.uses_autocast
    # Horovod's documented way to clip: finish the all-reduce, clip, then step without a second sync.
    can_clip = hasattr(optimizer, "synchronize") and hasattr(optimizer, "skip_synchronize")

    def step() -> torch.Tensor:
        with torch.autocast(setup.device.type, dtype=setup.precision.compute_dtype, enabled=autocast):
            output = model(inputs)
        loss = loss_of(output, targets)
        loss.backward()
        if can_clip:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step
