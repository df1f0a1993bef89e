"""A run whose loss or gradient norm is no longer finite stops, in one line, keeping its last
finite snapshot: a NaN spreads through AdamW's moments into every weight at the next step, so
training on (and snapshotting the result, and exiting 0) would only replace a good snapshot with a
useless one.

Each step's values are watched on the device (no read, so a GPU's host keeps queueing steps); the
watch is read where the loop reads values anyway (the logged steps), before every snapshot, and
at the end. Under fp16's loss scaler an infinite gradient norm is expected now and then (the
scaler skips that step and lowers its scale), so there only the loss is watched."""

from __future__ import annotations

import torch

from triax.errors import TriaxError
from triax.objectives.registry import loss_coefficients
from triax.runtime.shared_decisions import max_across_ranks


class NonFiniteTrainingError(TriaxError, FloatingPointError):
    """The training loss or gradient norm became inf or NaN: the run stops without saving that state."""


class FiniteWatch:
    """The first step (on this rank) whose loss or gradient norm was not finite, kept on the device."""

    def __init__(self, device: torch.device, scaler_enabled: bool):
        self.scaler_enabled = scaler_enabled
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        self.values = (float("nan"), float("nan"))

    def record(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> None:
        """Note `step` if its loss (or, without the scaler, its gradient norm) is not finite."""
        loss = torch.as_tensor(loss, device=self.first_bad.device).detach()
        grad_norm = torch.as_tensor(grad_norm, device=self.first_bad.device).detach()
        bad = ~torch.isfinite(loss)
        if not self.scaler_enabled:
            bad = bad | ~torch.isfinite(grad_norm)
        newly = bad & (self.first_bad < 0)
        self.first_bad = torch.where(newly, torch.full_like(self.first_bad, step), self.first_bad)
        self.latest = (loss, grad_norm)

    def check(self, last_snapshot: str | None, saved_step: int | None) -> None:
        """Raise on every rank (one agreement) if any rank saw a value that is not finite."""
        first = max_across_ranks(int(self.first_bad))
        if first < 0:
            return
        loss, grad_norm = (float(value) for value in self.latest)
        kept = (f"the last snapshot, {last_snapshot} (step {saved_step}), is kept" if last_snapshot
                else "no snapshot was written")
        raise NonFiniteTrainingError(
            f"the training loss or gradient norm stopped being finite at step {first} (now loss {loss:g}, gradient "
            f"norm {grad_norm:g}); the run stopped without saving that state and {kept}; lower optim.lr, set "
            f"trainer.grad_clip, or check the data and the loss's coefficients ({loss_coefficients()})")
