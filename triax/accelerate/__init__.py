"""`triax.Accelerator` and the rest of Hugging Face Accelerate's everyday surface (seed 003's door).

Mirrors Accelerate's import paths: `from triax.accelerate import Accelerator, PartialState,
notebook_launcher` and `from triax.accelerate.utils import set_seed, DistributedType, ...`.
"""

from triax.accelerate.accelerator import Accelerator
from triax.accelerate.data_loader import skip_first_batches
from triax.accelerate.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)
from triax.accelerate.fsdp_plugin import FullyShardedDataParallelPlugin
from triax.accelerate.launchers import notebook_launcher
from triax.accelerate.memory import find_executable_batch_size
from triax.accelerate.state import AcceleratorState, GradientState, PartialState

__all__ = [
    "Accelerator", "AcceleratorState", "AutocastKwargs", "DataLoaderConfiguration", "DistributedDataParallelKwargs",
    "DistributedType", "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin", "GradientState", "InitProcessGroupKwargs",
    "PartialState", "ProjectConfiguration", "find_executable_batch_size", "notebook_launcher", "skip_first_batches",
]
