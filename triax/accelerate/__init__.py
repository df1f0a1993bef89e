"""`triax.Accelerator`: bring your own training loop (seed 003's door)."""

from triax.accelerate.accelerator import Accelerator

__all__ = ["Accelerator"]
