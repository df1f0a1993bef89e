"""`triax.accelerate.utils`: the counterpart of `accelerate.utils`, so imports change line for line.

    from accelerate.utils import set_seed, DataLoaderConfiguration   # before
    from triax.accelerate.utils import set_seed, DataLoaderConfiguration   # after
"""

from __future__ import annotations

import functools
import importlib.metadata
import operator
from typing import Any

import torch
from packaging.version import Version, parse

from triax.accelerate._internal.errors import AcceleratorValueError, DistributedOperationException
from triax.accelerate._internal.fsdp_plugin import (
    FullyShardedDataParallelPlugin,
    disable_fsdp_ram_efficient_loading,
    enable_fsdp_ram_efficient_loading,
)
from triax.accelerate._internal.prepared_models import (
    extract_model_from_parallel,
    has_compiled_regions,
    is_compiled_module,
    load,
    save,
)
from triax.accelerate._internal.nested import (
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    find_device,
    honor_type,
    ignorant_find_batch_size,
    is_namedtuple,
    is_torch_tensor,
    listify,
    recursively_apply,
    send_to_device,
)
from triax.accelerate._internal.sharding import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler
from triax.accelerate._internal.surface import serve_absent
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
from triax.accelerate.launchers import notebook_launcher
from triax.accelerate.state import PartialState
from triax.accelerate.utils import constants, imports
from triax.accelerate.utils.constants import *  # noqa: F401,F403 (Accelerate's constants, listed in __all__)
from triax.accelerate.utils.dataclasses import (
    AutocastKwargs,
    ComputeEnvironment,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    PrecisionType,
    ProjectConfiguration,
    RNGType,
    SageMakerDistributedType,
)
from triax.accelerate.utils.environment import (
    check_os_kernel,
    clear_environment,
    get_int_from_env,
    is_port_in_use,
    parse_choice_from_env,
    parse_flag_from_env,
    patch_environment,
    str_to_bool,
)
from triax.accelerate.utils.imports import get_distributed_backend, get_torch_accelerator_backend
from triax.accelerate.utils.memory import (
    find_executable_batch_size,
    get_accelerator_free_memory,
    normalize_device,
    release_memory,
    should_reduce_batch_size,
)
from triax.accelerate.utils.operations import (
    CannotPadNestedTensorWarning,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from triax.accelerate.utils.random import SeedableRandomSampler, synchronize_rng_state, synchronize_rng_states
from triax.checkpoint.rng import seed_everything
from triax.runtime.shared_decisions import barrier as wait_for_everyone

# Accelerate's is_<thing>_available probes (triax.accelerate.utils.imports).
globals().update({name: getattr(imports, name) for name in imports.PROBES})


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


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """True on every process when `tensor` holds the same values on every process."""
    everyone = gather(tensor[None].clone().to(PartialState().device)).cpu()
    return all(torch.equal(row, everyone[0]) for row in everyone)


_COMPARISONS = {"<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">=": operator.ge,
                ">": operator.gt}


def compare_versions(library_or_version: str, operation: str, requirement_version: str) -> bool:
    """`<version> <operation> requirement_version`, where the version is given, or is that of the
    installed library named."""
    if operation not in _COMPARISONS:
        raise AcceleratorValueError(f"compare_versions got operation {operation!r}; use one of "
                                    f"{', '.join(_COMPARISONS)}")
    if isinstance(library_or_version, str):
        library_or_version = parse(importlib.metadata.version(library_or_version))
    return _COMPARISONS[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    return compare_versions(Version(torch.__version__.split("+")[0]), operation, version)


def get_pretty_name(obj: Any) -> str:
    """A readable name for a function, class or instance (its class's)."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or str(obj)


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge `source` into `destination` (nested dicts merged key by key); returns `destination`."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str):
    """getattr along a dotted path: recursive_getattr(model, "encoder.layer")."""
    return functools.reduce(getattr, attr.split("."), obj)


def convert_bytes(size: float) -> str:
    """A byte count in the largest unit below 1024 of it: '1.5 MB'."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any):
    """tqdm.auto.tqdm, shown only on each machine's local main process unless main_process_only=False."""
    from tqdm.auto import tqdm as progress_bar  # deferred: tqdm is imported only by scripts that use it

    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        disable = PartialState().local_process_index != 0
    return progress_bar(*args, disable=disable, **kwargs)


__all__ = sorted([
    "AutocastKwargs", "CannotPadNestedTensorWarning", "ComputeEnvironment", "DDPCommunicationHookType",
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "DistributedOperationException", "DistributedType",
    "DynamoBackend", "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
    "InitProcessGroupKwargs", "KwargsHandler", "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "LoggerType", "PrecisionType", "ProjectConfiguration", "RNGType", "SageMakerDistributedType",
    "SeedableRandomSampler", "are_the_same_tensors", "broadcast", "broadcast_object_list", "check_os_kernel",
    "clear_environment", "compare_versions", "concatenate", "convert_bytes",
    "convert_outputs_to_fp32", "convert_to_fp32", "extract_model_from_parallel", "find_batch_size", "find_device",
    "find_executable_batch_size", "gather", "get_accelerator_free_memory", "get_distributed_backend",
    "get_torch_accelerator_backend", "normalize_device", "gather_object", "get_int_from_env", "get_pretty_name",
    "has_compiled_regions", "honor_type", "ignorant_find_batch_size", "is_compiled_module", "is_namedtuple",
    "is_port_in_use", "is_torch_tensor", "is_torch_version", "listify", "load", "merge_dicts", "notebook_launcher",
    "pad_across_processes", "parse_choice_from_env", "parse_flag_from_env", "patch_environment",
    "prepare_data_loader", "recursive_getattr", "recursively_apply", "reduce", "release_memory", "save",
    "send_to_device", "set_seed", "should_reduce_batch_size", "skip_first_batches", "str_to_bool",
    "synchronize_rng_state", "synchronize_rng_states", "tqdm", "wait_for_everyone",
    # accelerate.data_loader's classes, kept here too (as SeedableRandomSampler and prepare_data_loader are)
    "BatchSamplerShard", "DataLoaderAdapter", "DataLoaderDispatcher", "DataLoaderShard", "DataLoaderStateMixin",
    "IterableDatasetShard", "SkipBatchSampler", "SkipDataLoader", "get_sampler",
    *(name for name in vars(constants) if name.isupper()), *imports.PROBES])

__getattr__, __dir__ = serve_absent(__name__)
