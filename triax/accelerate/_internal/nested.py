"""Nested data: tensors inside lists, tuples (named ones too) and mappings, as batches and model
outputs come. Accelerate's helpers for them, under its names (re-exported by triax.accelerate.utils);
every collective in triax.accelerate.utils.operations walks data with recursively_apply.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch

from triax.accelerate._internal.errors import AcceleratorTypeError, AcceleratorValueError


def is_torch_tensor(data: Any) -> bool:
    return isinstance(data, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """A namedtuple instance (a tuple with _fields and _asdict)."""
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


def is_mapping(data: Any) -> bool:
    # transformers' BatchEncoding is a Mapping; objects that only look like one (keys and .to) count too.
    return isinstance(data, Mapping) or (hasattr(data, "keys") and callable(getattr(data, "to", None)))


def honor_type(original: Any, items: Any):
    """`items` (an iterable) as a container of `original`'s type: list, tuple or namedtuple."""
    if is_namedtuple(original):
        return type(original)(*list(items))
    return type(original)(items)


def recursively_apply(function: Callable, data: Any, *args: Any, test_type: type | tuple[type, ...] = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs: Any):
    """`data` with function(leaf, *args, **kwargs) in place of every leaf for which test_type(leaf)
    is true, through lists, tuples and mappings (their types kept). Other leaves stay as they are,
    or raise TypeError with error_on_other_type."""
    if isinstance(data, (list, tuple)):
        return honor_type(data, (recursively_apply(function, item, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs)
                                 for item in data))
    if is_mapping(data):
        return type(data)({key: recursively_apply(function, data[key], *args, test_type=test_type,
                                                  error_on_other_type=error_on_other_type, **kwargs)
                           for key in data.keys()})
    if test_type(data):
        return function(data, *args, **kwargs)
    if error_on_other_type:
        raise AcceleratorTypeError(f"Unsupported types ({type(data)}) passed to `{function.__name__}`. Only nested "
                                   f"list/tuple/dicts of objects that are valid for `{test_type.__name__}` should be "
                                   "passed.")
    return data


def send_to_device(data: Any, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: str | list[str] | None = None):
    """`data` with every tensor (and every object with a .to method) moved to `device`; the values
    of a mapping's keys named in skip_keys (a key or a list) stay where they are."""
    if is_torch_tensor(data) or callable(getattr(data, "to", None)):
        try:
            return data.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to without non_blocking
            return data.to(device)
    if isinstance(data, (list, tuple)):
        return honor_type(data, (send_to_device(item, device, non_blocking, skip_keys) for item in data))
    if is_mapping(data):
        skipped = [skip_keys] if isinstance(skip_keys, str) else list(skip_keys or [])
        return type(data)({key: data[key] if key in skipped else send_to_device(data[key], device, non_blocking,
                                                                                 skip_keys)
                           for key in data.keys()})
    return data


def listify(data: Any):
    """`data` with every tensor as (nested) Python lists of numbers (bf16 read as fp32)."""
    def to_list(tensor: Any):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).tolist()

    return recursively_apply(to_list, data)


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor found (depth first)."""
    if isinstance(data, (list, tuple)) or is_mapping(data):
        if len(data) == 0:
            raise AcceleratorValueError(f"Cannot find the batch size from empty {type(data)}.")
        return find_batch_size(data[0] if isinstance(data, (list, tuple)) else data[next(iter(data.keys()))])
    if not is_torch_tensor(data):
        raise AcceleratorTypeError(f"Can only find the batch size of tensors but got {type(data)}.")
    return data.shape[0]


def ignorant_find_batch_size(data: Any):
    """find_batch_size, or None where it would raise."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def concatenate(data: list, dim: int = 0):
    """A list of same-structured batches as one batch: their tensors concatenated along `dim`."""
    first = data[0]
    if isinstance(first, (list, tuple)):
        return honor_type(first, (concatenate([item[index] for item in data], dim=dim) for index in range(len(first))))
    if is_mapping(first):
        return type(first)({key: concatenate([item[key] for item in data], dim=dim) for key in first.keys()})
    if is_torch_tensor(first):
        return torch.cat(list(data), dim=dim)
    if isinstance(data, (list, tuple)) and len(data) == 1:
        return first
    raise AcceleratorTypeError(f"Can only concatenate tensors but got {type(first)}")


def _is_half(data: Any) -> bool:
    return hasattr(data, "dtype") and data.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(data: Any):
    """`data` with every fp16 and bf16 tensor as fp32."""
    return recursively_apply(lambda tensor: tensor.float(), data, test_type=_is_half)


class _OutputsToFp32:
    """A forward whose outputs come back in fp32. Not picklable: a prepared model is pickled after
    unwrap_model / extract_model_from_parallel(keep_fp32_wrapper=False) removes it."""

    def __init__(self, forward: Callable):
        self.forward = forward
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any):
        return convert_to_fp32(self.forward(*args, **kwargs))

    def __getstate__(self):
        raise pickle.PicklingError("a model whose forward returns fp32 outputs of mixed precision cannot be "
                                   "pickled; unwrap it first (Accelerator.unwrap_model(model))")


def convert_outputs_to_fp32(forward: Callable):
    """`forward` with its fp16/bf16 outputs converted to fp32; `__wrapped__` leads back to it."""
    wrapped = _OutputsToFp32(forward)

    def forward_in_fp32(*args: Any, **kwargs: Any):
        return wrapped(*args, **kwargs)

    forward_in_fp32.__wrapped__ = wrapped
    return forward_in_fp32


def find_device(data: Any):
    """The device of the first tensor found in `data`, or None if it holds none."""
    if is_torch_tensor(data):
        return data.device
    items = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else ()
    for item in items:
        device = find_device(item)
        if device is not None:
            return device
    return None
