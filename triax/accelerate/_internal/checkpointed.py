"""What an Accelerator's save_state writes and its load_state restores, handed to the checkpoint
formats (accelerate_folder.py, fsdp_folder.py, saving.py) in place of the Accelerator itself: the
prepared models, optimizers, schedulers and dataloaders, the objects registered for checkpointing,
the loss scaler, the micro-step counters and the process. The formats read no private attribute of
the façade, and never need its module (which imports them) to name their argument's type."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triax.accelerate._internal.fsdp import FULL, state_dict_type

if TYPE_CHECKING:
    from triax.accelerate._internal.gradient_sync import GradientSync
    from triax.accelerate._internal.preparation import Preparation
    from triax.accelerate._internal.wrappers import PreparedOptimizer, PreparedScheduler
    from triax.accelerate.state import AcceleratorState, GradientState


class Checkpointed:
    """The live objects of one Accelerator that a checkpoint holds (read through its components, so
    what `prepare` adds later is seen)."""

    def __init__(self, prepared: Preparation, gradient_sync: GradientSync, custom_objects: list):
        self.prepared, self.gradient_sync, self.custom_objects = prepared, gradient_sync, custom_objects

    @property
    def models(self) -> list[torch.nn.Module]:
        return self.prepared.models

    @property
    def optimizers(self) -> list[PreparedOptimizer]:
        return self.prepared.optimizers

    @property
    def schedulers(self) -> list[PreparedScheduler]:
        return self.prepared.schedulers

    @property
    def dataloaders(self) -> list:
        return self.prepared.dataloaders

    @property
    def state(self) -> AcceleratorState:
        return self.prepared.state

    @property
    def gradient_state(self) -> GradientState:
        return self.prepared.gradient_state

    @property
    def grad_scaler(self) -> torch.amp.GradScaler:
        """Always a GradScaler (a disabled one where there is no fp16 loss scaling)."""
        return self.prepared.grad_scaler

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The scaler as Accelerate has one: only when it scales (fp16), else None."""
        return self.grad_scaler if self.grad_scaler.is_enabled() else None

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def step(self) -> int:
        """Accelerate's micro-step counter (saved with each process's random states)."""
        return self.gradient_sync.step

    @step.setter
    def step(self, value: int) -> None:
        self.gradient_sync.step = value

    @property
    def saves_full_state_dict(self) -> bool:
        """FSDP with state_dict_type FULL_STATE_DICT: save_state gathers the model and optimizer on
        process 0's CPU, which writes them alone (Accelerate's rule); otherwise each process
        writes its own shards."""
        plugin = self.state.fsdp_plugin
        return self.state.is_fsdp2 and plugin is not None and state_dict_type(plugin) == FULL
