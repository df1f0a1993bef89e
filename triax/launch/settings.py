"""The settings `triax launch` hands to `triax.Accelerator`, written once for both sides.

`triax launch` turns its options and config file into environment variables of the workers
(`to_environment`); an `Accelerator()` built without arguments reads them back (`from_environment`).
An argument passed to the Accelerator always wins over the environment.
"""

from __future__ import annotations

import os
from typing import Mapping

# Accelerate's precision names -> triax.runtime.precision policy names. `triax launch` offers Accelerate's
# three; the Accelerator also accepts triax's own names.
PRECISION_POLICIES = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16-pure"}
MIXED_PRECISION_CHOICES = ("no", "bf16", "fp16")
PARALLEL_CHOICES = ("ddp", "fsdp", "none")

# setting name (as in LaunchConfig and the Accelerator's arguments) -> environment variable
ENVIRONMENT = {
    "mixed_precision": "TRIAX_MIXED_PRECISION",
    "parallel": "TRIAX_PARALLEL",
    "use_cpu": "TRIAX_USE_CPU",
    "gradient_accumulation_steps": "TRIAX_GRADIENT_ACCUMULATION_STEPS",
}


# Set by `triax launch` in its workers: it prints the first failing rank's one-line error itself, as
# the last line of the job's output, so a triax command under it only leaves the line in torchrun's
# error file (triax.commands.cli.report_error).
ERRORS_REPORTED_BY_LAUNCHER_ENV = "TRIAX_LAUNCH_REPORTS_ERRORS"

# What `triax launch --grad-compression/--bucket-cap-mb` hands to triax.ddp_boost in every worker.
GRAD_COMPRESSION_ENV = "TRIAX_GRAD_COMPRESSION"
DDP_BUCKET_CAP_MB_ENV = "TRIAX_DDP_BUCKET_CAP_MB"


def to_environment(settings: object) -> dict[str, str]:
    """Environment variables for the workers from an object with the ENVIRONMENT attributes."""
    env = {}
    for name, variable in ENVIRONMENT.items():
        value = getattr(settings, name)
        env[variable] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def from_environment(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value `triax launch` set for setting `name`, or None when it set none."""
    env = os.environ if env is None else env
    return env.get(ENVIRONMENT[name]) or None


def flag_from_environment(name: str, env: Mapping[str, str] | None = None) -> bool:
    return (from_environment(name, env) or "").lower() in ("1", "true", "yes")


def accelerate_precision_name(policy: str) -> str:
    """A triax policy name -> the name to give an Accelerate-style `mixed_precision` argument."""
    return {"fp32": "no"}.get(policy, policy)
