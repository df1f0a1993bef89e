"""accelerate.scheduler's counterpart: AcceleratedScheduler is the scheduler Accelerator.prepare
returns (triax.accelerate._internal.wrappers.PreparedScheduler), so isinstance checks in scripts hold."""

from triax.accelerate._internal.wrappers import PreparedScheduler as AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
