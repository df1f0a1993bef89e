"""accelerate.optimizer's counterpart: AcceleratedOptimizer is the optimizer Accelerator.prepare
returns (triax.accelerate._internal.wrappers.PreparedOptimizer), so isinstance checks in scripts hold."""

from triax.accelerate._internal.surface import serve_absent
from triax.accelerate._internal.wrappers import PreparedOptimizer as AcceleratedOptimizer

__all__ = ["AcceleratedOptimizer"]

__getattr__, __dir__ = serve_absent(__name__)
