"""The optimizer and scheduler a prepared loop steps.

They exist for one reason each: inside `accumulate`, the user calls optimizer.step() and
scheduler.step() on every micro-step, but only the synchronising micro-step may update the
weights, and the scheduler must advance exactly once per real optimizer update (not once per
micro-step, and not once per process, which is a known bug in a peer library).
"""

from __future__ import annotations

import torch


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer. It subclasses Optimizer only so LR schedulers accept it; all
    state lives in the wrapped optimizer (Optimizer.__init__ is deliberately not called)."""

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state, scaler: torch.amp.GradScaler):
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self.step_was_skipped = False  # fp16: the scaler found inf/nan gradients and skipped
        self.num_steps = 0  # real updates so far
        self.gradients_unscaled = False

    # The wrapped optimizer's own containers, so code that edits param_groups (schedulers,
    # user code changing lr) edits the real thing.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getattr__(self, name):
        # Only reached for attributes this wrapper lacks (hooks, private fields of Optimizer).
        return getattr(self.__dict__["optimizer"], name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
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

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the wrapped LR scheduler once per real optimizer update."""

    def __init__(self, scheduler, optimizers: list[PreparedOptimizer], gradient_state,
                 step_with_optimizer: bool = True):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args, **kwargs) -> None:
        if self.step_with_optimizer:
            if not self.gradient_state.sync_gradients:
                return  # a micro-step inside `accumulate`: the optimizer did not update either
            if any(optimizer.step_was_skipped for optimizer in self.optimizers):
                return  # fp16 overflow: no update, so the schedule does not advance
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"
