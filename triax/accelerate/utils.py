"""`triax.accelerate.utils`: the counterpart of `accelerate.utils`, so imports change line for line.

    from accelerate.utils import set_seed, DataLoaderConfiguration   # before
    from triax.accelerate.utils import set_seed, DataLoaderConfiguration   # after
"""

from __future__ import annotations

import operator

import torch
from packaging.version import parse

from triax.checkpoint.rng import seed_everything

from triax.accelerate.data_loader import (
    DataLoaderAdapter,
    DataLoaderDispatcher,
    DataLoaderShard,
    DataLoaderStateMixin,
    SkipDataLoader,
    get_sampler,
    prepare_data_loader,
    skip_first_batches,
)
from triax.accelerate.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    LoggerType,
    PrecisionType,
    ProjectConfiguration,
)
from triax.accelerate.errors import DistributedOperationException
from triax.accelerate.launchers import notebook_launcher
from triax.accelerate.memory import find_executable_batch_size, release_memory, should_reduce_batch_size
from triax.accelerate.operations import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from triax.accelerate.random import SeedableRandomSampler, synchronize_rng_state, synchronize_rng_states
from triax.accelerate.sharding import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler
from triax.accelerate.state import PartialState
from triax.collectives import barrier as wait_for_everyone


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's `random`, NumPy and torch (every device). device_specific adds the process
    index, so processes draw different numbers; deterministic asks torch for deterministic kernels."""
    if device_specific:
        seed += PartialState().process_index
    seed_everything(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def are_the_same_tensors(tensor) -> bool:
    """True on every process when `tensor` holds the same values on every process."""
    everyone = gather(tensor[None].clone().to(PartialState().device)).cpu()
    return all(torch.equal(row, everyone[0]) for row in everyone)


def is_torch_version(operation: str, version: str) -> bool:
    compare = {"<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
               ">=": operator.ge, ">": operator.gt}[operation]
    return compare(parse(torch.__version__.split("+")[0]), parse(version))


__all__ = [
    "AutocastKwargs", "DataLoaderConfiguration", "DistributedDataParallelKwargs", "DistributedOperationException",
    "DistributedType", "SeedableRandomSampler", "are_the_same_tensors", "prepare_data_loader",
    "synchronize_rng_state", "synchronize_rng_states",
    "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs", "LoggerType", "PrecisionType",
    "ProjectConfiguration", "broadcast", "broadcast_object_list", "find_executable_batch_size", "gather",
    "gather_object", "is_torch_version", "notebook_launcher", "pad_across_processes", "reduce",
    "release_memory", "send_to_device", "set_seed", "should_reduce_batch_size", "skip_first_batches",
    "wait_for_everyone",
    # accelerate.data_loader's classes, kept here too (as SeedableRandomSampler and prepare_data_loader are)
    "BatchSamplerShard", "DataLoaderAdapter", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin",
    "IterableDatasetShard", "SkipBatchSampler", "SkipDataLoader", "get_sampler",
]
