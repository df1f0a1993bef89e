"""accelerate.scheduler's counterpart: AcceleratedScheduler is the scheduler Accelerator.prepare
returns (triax.accelerate.wrappers.PreparedScheduler), so isinstance checks in scripts hold."""

from triax.accelerate.wrappers import PreparedScheduler as AcceleratedScheduler

__all__ = ["AcceleratedScheduler"]
