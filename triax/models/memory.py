"""Whether a whole model fits in memory, checked from its config before it is allocated.

`triax eval` and `triax generate` hold one whole copy of the model per process. A config.json or
model.json describing terabytes would otherwise reach torch's allocator (a RuntimeError deep in a
traceback, or hours of swapping); the parameter count is exact (models.parameter_shapes: one block
built on the meta device, which allocates nothing), activations are not counted, so this only catches the
impossible, never refuses a model that would run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from triax.errors import ConfigError
from triax.runtime.host_memory import host_memory_bytes
from triax.models import parameter_shapes

if TYPE_CHECKING:
    from triax.models.config import GPTConfig


def check_whole_model_fits(config: GPTConfig, device: torch.device, what: str, processes: int = 1) -> None:
    """One line when the parameters of a model of `config` (in torch's default dtype) exceed the
    memory of `device` (the host's for a CPU, shared by `processes` processes)."""
    values = sum(math.prod(shape) for shape in parameter_shapes(config).values())
    needed = values * torch.get_default_dtype().itemsize
    if device.type == "cuda":
        memory, where = torch.cuda.get_device_properties(device).total_memory, str(device)
    else:
        memory = host_memory_bytes()
        where = "this host" if processes == 1 else f"each of this host's {processes} processes"
        memory = memory // processes if memory else None
    if memory is not None and needed > memory:
        raise ConfigError(f"{what} describes a model of {values:,} parameters, {needed / 2**30:,.1f} GiB in "
                          f"{torch.get_default_dtype()}, more than the {memory / 2**30:,.1f} GiB of {where}; "
                          "it is not this model's config, or it needs a larger machine")
