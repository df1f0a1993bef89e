"""`triax.Accelerator` and the rest of Hugging Face Accelerate's surface (seed 003's door).

Mirrors Accelerate's modules name by name: `from triax.accelerate import Accelerator, PartialState`,
`from triax.accelerate.utils import set_seed, ...`, `from triax.accelerate.logging import get_logger`,
and so on for state, data_loader, tracking, optimizer, scheduler, launchers, local_sgd, ...
(triax.accelerate._internal.surface lists them, with the names triax deliberately lacks: those import, and
raise one line naming the alternative when used).
"""

from triax.accelerate._internal.fsdp_plugin import FullyShardedDataParallelPlugin
from triax.accelerate._internal.surface import serve_absent
from triax.accelerate.accelerator import Accelerator
from triax.accelerate.data_loader import skip_first_batches
from triax.accelerate.launchers import debug_launcher, notebook_launcher
from triax.accelerate.state import AcceleratorState, GradientState, PartialState
from triax.accelerate.utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)
from triax.accelerate.utils.imports import is_rich_available
from triax.accelerate.utils.memory import find_executable_batch_size
from triax.accelerate.utils.random import synchronize_rng_states

__all__ = [
    "Accelerator", "AcceleratorState", "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
    "DistributedDataParallelKwargs", "DistributedType", "FullyShardedDataParallelPlugin",
    "GradScalerKwargs", "GradientAccumulationPlugin",
    "GradientState", "InitProcessGroupKwargs", "PartialState", "ProjectConfiguration", "debug_launcher",
    "find_executable_batch_size", "is_rich_available", "notebook_launcher", "skip_first_batches",
    "synchronize_rng_states",
]

__getattr__, __dir__ = serve_absent(__name__)
