"""The optimizer and scheduler a prepared loop steps.

They exist for one reason each: inside `accumulate`, the user calls optimizer.step() and
scheduler.step() on every micro-step, but only the synchronising micro-step may update the
weights, and the scheduler advances only with a real optimizer update.

How far the scheduler advances per update is Accelerate's rule by default: once per process when
each process reads its own batch (split_batches=False), so a schedule written for one process ends
after the same number of samples on N; once when batches are split. triax's preference, one step
per optimizer update whatever the layout, is the Accelerator's scheduler_steps="per_update".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from triax.accelerate.state import GradientState


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer. It subclasses Optimizer only so LR schedulers accept it; all
    state lives in the wrapped optimizer (Optimizer.__init__ is deliberately not called)."""

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState, scaler: torch.amp.GradScaler):
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self._is_overflow = False  # fp16: the scaler found inf/nan gradients and skipped the step
        self.num_steps = 0  # real updates so far
        self.gradients_unscaled = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() left the weights as they were (fp16 overflow). Accelerate keeps
        this in `_is_overflow`, which scripts and schedulers also read and set."""
        return self._is_overflow

    @step_was_skipped.setter
    def step_was_skipped(self, value: bool) -> None:
        self._is_overflow = value

    # Pickling and deepcopy take the wrapper's own fields; torch.optim.Optimizer's __setstate__
    # would look for Optimizer fields that live in the wrapped optimizer. The step state it shares
    # with the Accelerator is the process's, so a copy joins this process's GradientState.
    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "gradient_state"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()

    # The wrapped optimizer's own containers, so code that edits param_groups (schedulers,
    # user code changing lr) edits the real thing.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getattr__(self, name: str):
        # Only reached for attributes this wrapper lacks (hooks, private fields of Optimizer).
        if "optimizer" not in self.__dict__:  # half-built (while unpickling): nothing to forward to
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable | None = None):
        if not self.gradient_state.sync_gradients:
            return None
        if self.scaler.is_enabled():
            scale_before = self.scaler.get_scale()
            result = self.scaler.step(self.optimizer, closure) if closure else self.scaler.step(self.optimizer)
            self.scaler.update()
            self.step_was_skipped = self.scaler.get_scale() < scale_before
        else:
            result = self.optimizer.step(closure) if closure else self.optimizer.step()
            self.step_was_skipped = False
        self.gradients_unscaled = False
        if not self.step_was_skipped:
            self.num_steps += 1
        return result

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the wrapped LR scheduler with real optimizer updates: `steps_per_update` times each
    (see the module's docstring)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, optimizers: list[PreparedOptimizer],
                 gradient_state: GradientState, step_with_optimizer: bool = True, steps_per_update: int = 1,
                 count_micro_steps: bool = False):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_update = steps_per_update
        self.count_micro_steps = count_micro_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            # A micro-step inside `accumulate`: no update. Accelerate's rule (count_micro_steps)
            # with adjust_scheduler still advances the scheduler's own step counter.
            if self.count_micro_steps and self.gradient_state.adjust_scheduler and hasattr(
                    self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(optimizer.step_was_skipped for optimizer in self.optimizers):
            return  # fp16 overflow: no update, so the schedule does not advance
        for _ in range(self.steps_per_update):
            # OneCycleLR raises past its total_steps: stop there, as Accelerate does.
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        if "scheduler" not in self.__dict__:  # half-built (while unpickling): nothing to forward to
            raise AttributeError(name)
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"
