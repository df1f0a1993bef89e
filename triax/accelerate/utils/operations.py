"""Collectives on nested data (tensors inside dicts, lists and tuples), for the user's own loop.

Every function is a no-op copy when the job has one process, so a script runs unchanged under
`python`, `torchrun` or `triax launch`. They are built on torch.distributed; gloo has no
all_gather_into_tensor for every dtype, so the list form of all_gather is used throughout.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
import torch.distributed as dist

from triax.accelerate._internal.errors import (  # noqa: F401 - Accelerate's name in this module
    DistributedOperationException,
)
from triax.accelerate._internal.errors import AcceleratorValueError, distributed_operation_error
from triax.accelerate._internal.nested import is_mapping, recursively_apply, send_to_device  # noqa: F401 (re-exported)
from triax.runtime.collectives_at_exit import wait_and_keep
from triax.runtime.process_group import collective_device, is_distributed
from triax.runtime.shared_decisions import all_gather_bytes


# Every function here walks nested data the same way (triax.accelerate._internal.nested).
map_tensors = recursively_apply


class CannotPadNestedTensorWarning(UserWarning):
    """pad_across_processes met a nested tensor (sizes that vary inside it) and left it unpadded."""


def signature(data: Any, full_shape: bool) -> list[str]:
    """One line per node of a nested structure: container kinds with their keys or lengths, and
    each tensor's dtype and shape (the first dimension as * unless `full_shape`; with
    full_shape=None only the number of dimensions counts)."""
    lines: list[str] = []

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor) and value.is_nested:
            lines.append(f"{path}: nested tensor of {value.size(0)}")
        elif isinstance(value, torch.Tensor):
            shape = list(value.shape) if value.dim() else [1]
            shown = {True: shape, False: ["*", *shape[1:]], None: ["*"] * len(shape)}[full_shape]
            lines.append(f"{path}: {str(value.dtype).removeprefix('torch.')} tensor {shown}".replace("'", ""))
        elif is_mapping(value):
            keys = list(value.keys())
            lines.append(f"{path}: {type(value).__name__} with keys {keys}")
            for key in keys:
                visit(value[key], f"{path}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            lines.append(f"{path}: {type(value).__name__} of {len(value)}")
            for index, item in enumerate(value):
                visit(item, f"{path}[{index}]")
        else:
            lines.append(f"{path}: {type(value).__name__}")

    visit(data, "data")
    return lines


def check_same_everywhere(data: Any, what: str, full_shape: bool = False) -> None:
    """Raise the same DistributedOperationException on every process if the structure, keys, dtypes or
    shapes of `data` differ between processes, before any data moves (a mismatched all_gather can
    abort the process inside the backend). Costs one all_gather of a 32-byte digest."""
    if not is_distributed():
        return
    lines = signature(data, full_shape)
    text = "\n".join(lines).encode()
    device = collective_device()
    digest = torch.tensor(list(hashlib.sha256(text).digest()), dtype=torch.uint8, device=device)
    digests = [torch.zeros_like(digest) for _ in range(dist.get_world_size())]
    wait_and_keep(dist.all_gather(digests, digest, async_op=True))
    if all(torch.equal(item, digests[0]) for item in digests):
        return
    texts = [payload.decode().split("\n") for payload in all_gather_bytes(text)]
    reference = texts[0]
    for rank, other in enumerate(texts[1:], start=1):
        for mine, theirs in zip(reference + ["(nothing)"] * len(other), other + ["(nothing)"] * len(reference)):
            if mine != theirs:
                raise distributed_operation_error(
                    f"{what} got different data on different processes: process 0 has {mine!r:.200}, "
                    f"process {rank} has {theirs!r:.200}; every process must pass the same structure "
                    f"(keys, dtypes and shapes{'' if full_shape else ' except the first dimension'})")
    raise distributed_operation_error(f"{what} got different data on different processes")  # digest only


def _world() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _sizes_along(tensor: torch.Tensor, dim: int) -> list[int]:
    """Every process's size of `tensor` along `dim` (one tiny all_gather)."""
    mine = torch.tensor([tensor.shape[dim] if tensor.dim() else 1, tensor.dim()], device=tensor.device)
    everyone = [torch.zeros_like(mine) for _ in range(_world())]
    wait_and_keep(dist.all_gather(everyone, mine, async_op=True))
    ranks = {int(item[1]) for item in everyone}
    if len(ranks) != 1:
        raise AcceleratorValueError(f"gather got tensors with different numbers of dimensions across processes "
                         f"({sorted(ranks)}); give every process tensors of the same rank")
    return [int(item[0]) for item in everyone]


def _pad_to(tensor: torch.Tensor, size: int, dim: int, pad_index: int = 0, pad_first: bool = False) -> torch.Tensor:
    if tensor.shape[dim] == size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size - tensor.shape[dim]
    padding = tensor.new_full(shape, pad_index)
    pieces = [padding, tensor] if pad_first else [tensor, padding]
    return torch.cat(pieces, dim=dim)


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 0:
        tensor = tensor[None]
    tensor = tensor.contiguous()
    sizes = _sizes_along(tensor, 0)
    # Uneven first dimensions are padded for the collective and trimmed after, so gather never
    # hangs or fails on a short last batch.
    padded = _pad_to(tensor, max(sizes), 0)
    pieces = [torch.empty_like(padded) for _ in sizes]
    wait_and_keep(dist.all_gather(pieces, padded, async_op=True))
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)], dim=0)


def gather(data: Any):
    """Concatenate every process's tensors along the first dimension, in process order.
    Scalars become 1-element tensors first."""
    if not is_distributed():
        return map_tensors(lambda tensor: tensor[None] if tensor.dim() == 0 else tensor, data)
    check_same_everywhere(data, "gather")
    return map_tensors(_gather_one, data)


def gather_object(items: list) -> list:
    """Concatenate every process's list of picklable objects, in process order."""
    if not is_distributed():
        return list(items)
    everyone = [None] * _world()
    dist.all_gather_object(everyone, list(items))
    return [item for part in everyone for item in part]


def pad_across_processes(data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
    """Pad each tensor along `dim` to the largest size any process has, so they can be gathered.
    A tensor without dimension `dim` is left as it is; so is a nested tensor, with a
    CannotPadNestedTensorWarning (its sizes vary inside it)."""
    if is_distributed():
        check_same_everywhere(data, "pad_across_processes", full_shape=None)

    def pad(tensor: torch.Tensor):
        if tensor.is_nested:
            warnings.warn("pad_across_processes cannot pad a nested tensor (its sizes vary inside it); it is "
                          "returned as it is", CannotPadNestedTensorWarning, stacklevel=4)
            return tensor
        if not is_distributed() or dim >= tensor.dim() or dim < -tensor.dim():
            return tensor
        return _pad_to(tensor, max(_sizes_along(tensor, dim)), dim, pad_index, pad_first)

    return map_tensors(pad, data)


# reduce's reductions: what each process contributes is combined with this torch.distributed op.
REDUCE_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def reduce(data: Any, reduction: str = "mean", scale: float = 1.0):
    """Average ("mean", the default, as Accelerate's function), sum ("sum") or take the largest
    value ("max") of each tensor over processes, element-wise; "none" leaves it. Returns copies,
    multiplied by `scale`. (The Accelerator's method defaults to "sum", as Accelerate's does.)"""
    if reduction not in (*REDUCE_OPS, "none"):
        raise AcceleratorValueError(f"reduce got reduction={reduction!r}; use 'mean', 'sum', 'max' or 'none'")
    if reduction != "none":
        check_same_everywhere(data, "reduce", full_shape=True)

    def one(tensor: torch.Tensor):
        result = tensor.clone()
        if is_distributed() and reduction != "none":
            wait_and_keep(dist.all_reduce(result, op=REDUCE_OPS[reduction], async_op=True))
            if reduction == "mean":
                result = result / _world()
        return result * scale if scale != 1.0 else result

    return map_tensors(one, data)


def broadcast(data: Any, from_process: int = 0):
    """Every process gets process `from_process`'s tensors (same shapes required), in place."""
    if not is_distributed():
        return data
    check_same_everywhere(data, "broadcast", full_shape=True)

    def one(tensor: torch.Tensor):
        wait_and_keep(dist.broadcast(tensor, src=from_process, async_op=True))
        return tensor

    return map_tensors(one, data)


def broadcast_object_list(objects: list, from_process: int = 0) -> list:
    if is_distributed():
        dist.broadcast_object_list(objects, src=from_process)
    return objects


def slice_for_process(inputs: Any, process_index: int, num_processes: int, apply_padding: bool = False):
    """This process's contiguous share of a list, tuple, tensor, datasets.Dataset (anything with
    `select(indices)`), or dict of those (of one length): the first len % num_processes processes
    take one extra item. With apply_padding every share has the same length, the short ones
    repeating the last item of `inputs` (so results can be gathered). Other objects, and
    everything with one process, come back as they are."""
    if num_processes == 1:
        return inputs
    if isinstance(inputs, dict):
        lengths = {len(value) for value in inputs.values()}
        if len(lengths) > 1:
            raise AcceleratorValueError(f"split_between_processes got a dict whose values have lengths "
                                        f"{sorted(lengths)}; give every value the same length")
        length = lengths.pop() if lengths else 0
    elif isinstance(inputs, (list, tuple, torch.Tensor)) or callable(getattr(inputs, "select", None)):
        length = len(inputs)
    else:
        return inputs
    base, extra = divmod(length, num_processes)
    start = process_index * base + min(process_index, extra)
    end = start + base + (1 if process_index < extra else 0)
    padding = (base + (1 if extra else 0)) - (end - start) if apply_padding and length else 0
    return _share(inputs, start, end, padding)


def _share(inputs: Any, start: int, end: int, padding: int):
    """inputs[start:end] followed by `padding` copies of inputs' last item."""
    if isinstance(inputs, dict):
        return {key: _share(value, start, end, padding) for key, value in inputs.items()}
    if callable(getattr(inputs, "select", None)) and not isinstance(inputs, (list, tuple, torch.Tensor)):
        return inputs.select(list(range(start, end)) + [len(inputs) - 1] * padding)
    share = inputs[start:end]
    if not padding:
        return share
    if isinstance(share, torch.Tensor):
        return torch.cat([share, inputs[-1:].expand(padding, *inputs.shape[1:])])
    return share + type(share)([inputs[-1]] * padding)
