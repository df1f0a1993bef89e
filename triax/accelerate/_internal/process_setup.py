"""The Accelerator's first act: join the process group (or use the one the script created) once
per process, and settle the precision on the device that gives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from triax.accelerate.state import AcceleratorState, share_with_accelerate
from triax.runtime.precision import Precision

if TYPE_CHECKING:
    from triax.accelerate._internal.options import Options


def join_process_state(options: Options) -> tuple[AcceleratorState, Precision]:
    """The process's AcceleratorState and the Precision it runs with."""
    precision = Precision(options.precision_policy)
    mixed_precision = {"fp32": "no"}.get(options.mixed_precision, options.mixed_precision)
    state = AcceleratorState(mixed_precision=mixed_precision, cpu=options.cpu, timeout=options.init_timeout,
                             backend=options.init_backend)
    state.fsdp = options.parallel == "fsdp"
    state.fsdp_plugin = options.fsdp_plugin
    state._dynamo_plugin = options.dynamo
    if precision.needs_loss_scaling and state.device.type == "cpu":
        # As Accelerate: fp16 on CPU is accepted and runs without autocast or loss scaling
        # (fp32 arithmetic); the state still reports "fp16".
        precision = Precision("fp32")
    precision.check_device(state.device)
    share_with_accelerate(state.mixed_precision, cpu=state.device.type == "cpu")
    return state, precision
