"""LocalSGD (accelerate.local_sgd's counterpart): each process takes `local_sgd_steps` optimizer
steps on its own, without synchronising gradients, then every process's parameters are replaced
by their average. It trades the per-step all-reduce for a parameter all-reduce every K steps.

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            ...
            optimizer.step()
            local_sgd.step()

Plain data parallel only (distributed_type NO, MULTI_CPU, MULTI_GPU, ...), as in Accelerate: a
sharded model (FSDP) has no whole parameters on a process to average.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from triax.accelerate._internal.errors import UnsupportedFeatureError
from triax.accelerate.state import MULTI_DEVICE_TYPES
from triax.accelerate.utils.dataclasses import DistributedType

if TYPE_CHECKING:
    from triax.accelerate.accelerator import Accelerator

__all__ = ["LocalSGD"]


class LocalSGD:
    """Context manager: inside it the model's backward passes do not synchronise gradients; step()
    averages the parameters over processes every `local_sgd_steps` calls, and leaving the block
    averages them once more. enabled=False (or a single process) makes it do nothing."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        kind = accelerator.distributed_type
        if kind != DistributedType.NO and kind not in MULTI_DEVICE_TYPES:
            raise UnsupportedFeatureError(f"LocalSGD needs plain data parallel processes (this is {kind}); "
                                          "use Accelerator(parallel='ddp') or drop LocalSGD")
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self._no_sync = contextlib.ExitStack()

    def __enter__(self):
        if self.enabled:
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, *exception: Any):
        if self.enabled:
            self._average_parameters()
            self._no_sync.close()
        return False

    def step(self) -> None:
        """Count one optimizer step; every local_sgd_steps-th one averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    def _average_parameters(self) -> None:
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.data = self.accelerator.reduce(parameter.data, reduction="mean")
