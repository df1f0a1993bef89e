"""The step through Hugging Face Accelerate, when it is installed (a peer, not a dependency)."""

from __future__ import annotations

from triax.bench.adapters import StepSetup, Unavailable
from triax.bench.adapters._accelerate_loop import accelerate_step, ddp_kwargs_handlers, mixed_precision_name


def make_step(setup: StepSetup):
    try:
        import accelerate
    except ImportError:
        raise Unavailable("accelerate is not installed (pip install accelerate)") from None
    if setup.grad_compression != "none":
        raise Unavailable("grad_compression is not passed to HF Accelerate by the bench")
    accelerator = accelerate.Accelerator(
        mixed_precision=mixed_precision_name(setup), cpu=setup.device.type == "cpu",
        kwargs_handlers=ddp_kwargs_handlers(accelerate, setup))
    return accelerate_step(accelerator, setup)
