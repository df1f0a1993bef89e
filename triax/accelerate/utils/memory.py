"""find_executable_batch_size: retry a function with a smaller batch size while it runs out of memory."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorTypeError
from triax.accelerate.utils.imports import get_torch_accelerator_backend

# Parts of the messages of RuntimeErrors that mean "out of memory", on every device torch runs on
# (older torch raised plain RuntimeErrors, and some devices still do): "<DEVICE> out of memory."
# (CUDA, HIP, XPU, CPU...), Apple's MPS, a cuDNN refusal that goes away with a smaller batch, the
# CPU allocator, and Intel Gaudi's (HPU) device-memory allocator.
OUT_OF_MEMORY_MESSAGES = (" out of memory.", "MPS backend out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                          "DefaultCPUAllocator: can't allocate memory", "MODULE:PT_DEVMEM Allocation failed")


def should_reduce_batch_size(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return (isinstance(error, RuntimeError) and len(error.args) == 1 and isinstance(error.args[0], str)
            and any(message in error.args[0] for message in OUT_OF_MEMORY_MESSAGES))


def release_memory(*objects: Any):
    """Drop references and empty the allocator caches; returns Nones to assign back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [None] * len(objects)


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable | None = None):
    """Decorator: call `function(batch_size, *args)` starting at `starting_batch_size`; on an
    out-of-memory error, free caches and retry with the batch size reduced (to 90% by default, or
    by `reduce_batch_size_fn()`), until it succeeds or reaches zero. The decorated function is
    called without the batch size. Each process decides alone, as in Accelerate."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    def reduce_by_tenth():
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn or reduce_by_tenth

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any):
        nonlocal batch_size
        parameters = list(inspect.signature(function).parameters)
        if len(parameters) < len(args) + 1:
            raise AcceleratorTypeError(f"{function.__name__} was called with the batch size as well; the "
                                       f"decorator passes it: call {function.__name__}() with the other "
                                       "arguments only")
        while True:
            if batch_size <= 0:
                raise AcceleratorRuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
                release_memory()
                batch_size = reduce()

    return run


def get_accelerator_free_memory(device_module: Any, device_index: int) -> int:
    """Free bytes on device `device_index`, asked through the module get_torch_accelerator_backend returned."""
    if device_module is torch.accelerator and hasattr(device_module, "get_memory_info"):
        return device_module.get_memory_info(device_index)[0]
    if device_module is torch.accelerator:
        device_module = torch.get_device_module(torch.accelerator.current_accelerator())
    return device_module.mem_get_info(device_index)[0]


def normalize_device(device: Any) -> Any:
    """A device as the big-model helpers take it: an integer index becomes '<type>:<index>' on accelerators
    other than CUDA (whose bare integers torch already takes); 'npu' gets its index 0."""
    if device == "npu":
        return "npu:0"
    if isinstance(device, int):
        device_type, _ = get_torch_accelerator_backend(check_available=False)
        if device_type == "hpu":
            return "hpu"
        if device_type not in (None, "cuda"):
            return f"{device_type}:{device}"
    return device
