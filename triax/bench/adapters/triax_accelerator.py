"""The step through triax.Accelerator (the HF-Accelerate-compatible door)."""

from __future__ import annotations

from triax.bench.adapters import StepSetup, Unavailable
from triax.bench.adapters._accelerate_loop import accelerate_step, ddp_kwargs_handlers, mixed_precision_name


def make_step(setup: StepSetup):
    # triax's own door: failing to import it is a bug to report as a failed row, never "not available".
    import triax.accelerate as module
    from triax.accelerate import Accelerator

    if setup.grad_compression != "none":
        raise Unavailable("grad_compression is not passed to the Accelerator by the bench")
    handlers = ddp_kwargs_handlers(module, setup)
    kwargs = {"mixed_precision": mixed_precision_name(setup)}
    if handlers:
        kwargs["kwargs_handlers"] = handlers
    return accelerate_step(Accelerator(**kwargs), setup)
