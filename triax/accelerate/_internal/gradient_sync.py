"""Gradient accumulation and synchronisation for the Accelerator: the loss's division and scaling
in `backward`, the micro-steps of `accumulate` (which of them all-reduce gradients), joining
processes that run out of batches, and unscaling fp16 gradients before they are inspected.

Whether a micro-step synchronises is GradientState's decision (triax.accelerate.state); this
component applies it to the prepared models and counts Accelerate's micro-step (`step`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from triax.accelerate._internal.preparation import Preparation
from triax.accelerate._internal.wrappers import PreparedOptimizer
from triax.accelerate.data_loader import DataLoaderDispatcher
from triax.accelerate.state import GradientState
from triax.accelerate.utils.dataclasses import DistributedType
from triax.parallel.no_sync import no_sync
from triax.runtime.precision import Precision

if TYPE_CHECKING:
    from triax.accelerate._internal.options import Options


def start_accumulation(options: Options, precision: Precision, device: torch.device
                       ) -> tuple[GradientState, torch.amp.GradScaler]:
    """The GradientState of gradient accumulation, and the loss scaler."""
    plugin = options.accumulation
    # Accelerate's GradientState keeps the plugin's to_kwargs() (the fields changed from their
    # defaults) and reads adjust_scheduler from it with default False: the plugin's default True
    # never reaches the scheduler. Followed, since the scheduler's saved _step_count depends on it.
    recorded = plugin.to_kwargs()
    gradient_state = GradientState(plugin.num_steps, sync_with_dataloader=plugin.sync_with_dataloader,
                                   sync_each_batch=plugin.sync_each_batch,
                                   adjust_scheduler=recorded.get("adjust_scheduler", False),
                                   plugin_kwargs=recorded)
    # Always a GradScaler inside (a disabled one passes losses and steps through unchanged);
    # the Accelerator's `scaler` shows it only when it scales, as Accelerate's is None without fp16.
    grad_scaler = precision.make_scaler(device)
    if grad_scaler.is_enabled() and options.scaler_options:
        grad_scaler = torch.amp.GradScaler(device.type, **options.scaler_options)
    return gradient_state, grad_scaler


class GradientSync:
    """backward, accumulate, join_uneven_inputs and unscale_gradients of one Accelerator."""

    def __init__(self, gradient_state: GradientState, grad_scaler: torch.amp.GradScaler, prepared: Preparation):
        self.gradient_state = gradient_state
        self.grad_scaler = grad_scaler
        self.prepared = prepared
        # Accelerate's micro-step counter: +1 per `accumulate` block, 0 again after a dataloader's
        # last batch (sync_with_dataloader); scripts read it, the decision is GradientState's.
        self.step = 0

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.gradient_state.accumulation_steps > 1:
            loss = loss / self.gradient_state.accumulation_steps
        self.grad_scaler.scale(loss).backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, models: tuple[torch.nn.Module, ...]) -> Iterator[None]:
        state = self.gradient_state
        self.step = 0 if state.sync_with_dataloader and state.end_of_dataloader else self.step + 1
        sync = state.next_micro_step() or state.sync_each_batch
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    stack.enter_context(no_sync(model))
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None) -> Iterator[None]:
        from torch.distributed.algorithms.join import Join, Joinable  # deferred: only uneven inputs need Join

        state = self.prepared.state
        if not state.multi_device:
            if state.distributed_type != DistributedType.NO:
                warnings.warn("join_uneven_inputs is only supported for multi-GPU and multi-CPU data parallel "
                              f"training (this is {state.distributed_type}); it has no effect here", stacklevel=3)
            yield
            return
        if even_batches is not None:
            saved = self._override_even_batches(even_batches)
        else:
            saved, even_batches = [], self.prepared.dataloader_config.even_batches
        items = [getattr(item, "optimizer", item) if isinstance(item, PreparedOptimizer) else item
                 for item in joinables]
        items = [item for item in items if isinstance(item, Joinable)]
        try:
            if items and not even_batches:
                with Join(items, enable=True, throw_on_early_termination=False):
                    yield
            else:
                yield
        finally:
            for loader, value in saved:
                loader.batch_sampler.even_batches = value

    def _override_even_batches(self, even_batches: bool) -> list[tuple[Any, bool]]:
        """Set even_batches on the prepared map-style dataloaders; returns what to restore."""
        saved = []
        dataloaders = self.prepared.dataloaders
        for loader in dataloaders:
            if isinstance(loader, DataLoaderDispatcher) or not hasattr(loader.batch_sampler, "even_batches"):
                continue
            saved.append((loader, loader.batch_sampler.even_batches))
            loader.batch_sampler.even_batches = even_batches
        if any(isinstance(loader, DataLoaderDispatcher) for loader in dataloaders):
            warnings.warn("join_uneven_inputs(even_batches=...) is only supported for map-style datasets; "
                          "the prepared dataloaders over iterable datasets keep their setting", stacklevel=4)
        return saved

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | list | tuple | None = None) -> None:
        if not self.grad_scaler.is_enabled() or not self.gradient_state.sync_gradients:
            return
        targets = self.prepared.optimizers if optimizer is None else (
            optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
        for target in targets:
            if isinstance(target, PreparedOptimizer) and not target.gradients_unscaled:
                self.grad_scaler.unscale_(target.optimizer)
                target.gradients_unscaled = True

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(optimizer.step_was_skipped for optimizer in self.prepared.optimizers)
