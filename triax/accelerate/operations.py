"""Collectives on nested data (tensors inside dicts, lists and tuples), for the user's own loop.

Every function is a no-op copy when the job has one process, so a script runs unchanged under
`python`, `torchrun` or `triax launch`. They are built on torch.distributed; gloo has no
all_gather_into_tensor for every dtype, so the list form of all_gather is used throughout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from triax.errors import TriaxError
from triax.runtime import is_distributed


def map_tensors(function, data):
    """Apply `function` to every tensor in a nested structure, keeping its shape and types."""
    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, dict):
        return type(data)({key: map_tensors(function, value) for key, value in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(function, value) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(function, value) for value in data)
    if hasattr(data, "to") and callable(data.to) and hasattr(data, "keys"):  # BatchEncoding-like
        return type(data)({key: map_tensors(function, data[key]) for key in data.keys()})
    return data


def send_to_device(data, device: torch.device, non_blocking: bool = False):
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=non_blocking), data)


def _world() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _sizes_along(tensor: torch.Tensor, dim: int) -> list[int]:
    """Every process's size of `tensor` along `dim` (one tiny all_gather)."""
    mine = torch.tensor([tensor.shape[dim] if tensor.dim() else 1, tensor.dim()], device=tensor.device)
    everyone = [torch.zeros_like(mine) for _ in range(_world())]
    dist.all_gather(everyone, mine)
    ranks = {int(item[1]) for item in everyone}
    if len(ranks) != 1:
        raise TriaxError(f"gather got tensors with different numbers of dimensions across processes "
                         f"({sorted(ranks)}); give every process tensors of the same rank")
    return [int(item[0]) for item in everyone]


def _pad_to(tensor: torch.Tensor, size: int, dim: int, pad_index=0, pad_first: bool = False) -> torch.Tensor:
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
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)], dim=0)


def gather(data):
    """Concatenate every process's tensors along the first dimension, in process order.
    Scalars become 1-element tensors first."""
    if not is_distributed():
        return map_tensors(lambda tensor: tensor[None] if tensor.dim() == 0 else tensor, data)
    return map_tensors(_gather_one, data)


def gather_object(items: list) -> list:
    """Concatenate every process's list of picklable objects, in process order."""
    if not is_distributed():
        return list(items)
    everyone = [None] * _world()
    dist.all_gather_object(everyone, list(items))
    return [item for part in everyone for item in part]


def pad_across_processes(data, dim: int = 0, pad_index=0, pad_first: bool = False):
    """Pad each tensor along `dim` to the largest size any process has, so they can be gathered."""
    if not is_distributed():
        return data

    def pad(tensor):
        if dim >= tensor.dim() or dim < -tensor.dim():
            return tensor
        return _pad_to(tensor, max(_sizes_along(tensor, dim)), dim, pad_index, pad_first)

    return map_tensors(pad, data)


def reduce(data, reduction: str = "sum", scale: float = 1.0):
    """Sum ("sum") or average ("mean") each tensor over processes; "none" leaves it. Returns copies."""
    if reduction not in ("sum", "mean", "none"):
        raise TriaxError(f"reduce got reduction={reduction!r}; use 'sum', 'mean' or 'none'")

    def one(tensor):
        result = tensor.clone()
        if is_distributed() and reduction != "none":
            dist.all_reduce(result, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                result = result / _world()
        return result * scale if scale != 1.0 else result

    return map_tensors(one, data)


def broadcast(data, from_process: int = 0):
    """Every process gets process `from_process`'s tensors (same shapes required), in place."""
    if not is_distributed():
        return data

    def one(tensor):
        dist.broadcast(tensor, src=from_process)
        return tensor

    return map_tensors(one, data)


def broadcast_object_list(objects: list, from_process: int = 0) -> list:
    if is_distributed():
        dist.broadcast_object_list(objects, src=from_process)
    return objects


def slice_for_process(inputs, process_index: int, num_processes: int, apply_padding: bool = False):
    """This process's contiguous share of a list, tuple, tensor or dict of them: the first
    len % num_processes processes take one extra item. With apply_padding every share has the
    same length, the short ones repeating their last item (so results can be gathered)."""
    if isinstance(inputs, dict):
        return {key: slice_for_process(value, process_index, num_processes, apply_padding)
                for key, value in inputs.items()}
    length = len(inputs)
    base, extra = divmod(length, num_processes)
    start = process_index * base + min(process_index, extra)
    end = start + base + (1 if process_index < extra else 0)
    share = inputs[start:end]
    if apply_padding and extra and process_index >= extra and length:
        last = inputs[end - 1:end] if end > start else inputs[-1:]
        if isinstance(share, torch.Tensor):
            share = torch.cat([share, last])
        else:
            share = share + type(share)(last)
    return share
