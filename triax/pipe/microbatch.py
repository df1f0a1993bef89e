"""Cutting a mini-batch into micro-batches and putting the outputs back together.

A batch is what a layer of the pipe receives: one tensor, or a tuple of tensors that travel
together (for example activations plus a mask). Every tensor of a tuple is cut along dimension 0,
so they must share their batch size.
"""

from __future__ import annotations

from typing import Union

import torch

from triax.pipe.errors import PipeTypeError, PipeValueError

Batch = Union[torch.Tensor, tuple]


def check_tensors(batch: object, what: str = "Pipe input") -> None:
    """Refuse anything that is not a tensor or a non-empty tuple of tensors (TypeError, as FairScale)."""
    if isinstance(batch, torch.Tensor):
        return
    if not isinstance(batch, tuple) or not batch:
        raise PipeTypeError(f"{what} must be a tensor or a tuple of tensors, got {type(batch).__name__}; "
                         "wrap several inputs in a tuple")
    for position, item in enumerate(batch):
        if not isinstance(item, torch.Tensor):
            raise PipeTypeError(f"{what} element {position} is a {type(item).__name__}, not a tensor; "
                             "only tensors can be cut into micro-batches")


def check_batch(batch: object, what: str = "Pipe input") -> None:
    """`check_tensors`, and every tensor has a batch dimension of one size to cut micro-batches from."""
    check_tensors(batch, what)
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise PipeValueError(f"{what} is a 0-dimensional tensor; the pipe cuts batches along dimension 0, "
                             "so give it at least one dimension")
        return
    for position, item in enumerate(batch):
        if item.dim() == 0:
            raise PipeValueError(f"{what} element {position} is a 0-dimensional tensor; give it a batch dimension")
    sizes = [item.size(0) for item in batch]
    if len(set(sizes)) != 1:
        raise PipeValueError(f"{what} tensors have different batch sizes {sizes}; "
                         "every tensor of the tuple is cut along dimension 0, so they must agree")


def coerce_chunks(chunks: object) -> int:
    """`int(chunks)`, as FairScale does (4.0 and "4" are 4), refusing what int() would truncate."""
    try:
        whole = int(chunks)
    except TypeError:
        raise PipeTypeError(f"chunks must be a whole number of micro-batches >= 1, got {chunks!r}") from None
    except ValueError:
        raise PipeValueError(f"chunks must be a whole number of micro-batches >= 1, got {chunks!r}") from None
    if whole < 1 or (isinstance(chunks, float) and whole != chunks):
        raise PipeValueError(f"chunks must be a whole number of micro-batches >= 1, got {chunks!r}")
    return whole


def split(batch: Batch, chunks: int) -> list[Batch]:
    """Cut `batch` into at most `chunks` micro-batches along dimension 0.

    Like `torch.chunk`, a batch smaller than `chunks` gives fewer, and the last piece may be smaller.
    """
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(chunks))
    pieces = [item.chunk(chunks) for item in batch]
    return [tuple(piece[index] for piece in pieces) for index in range(len(pieces[0]))]


def join(outputs: list[Batch]) -> Batch:
    """Concatenate micro-batch outputs back into one mini-batch along dimension 0."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs) if len(outputs) > 1 else first
    return tuple(torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*outputs))


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Copy a batch to `device`; autograd records the copy, so gradients flow back across it."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return tuple(item.to(device) for item in batch)


def tensors_of(batch: Batch) -> tuple:
    """A batch as a flat tuple of tensors (what torch.utils.checkpoint takes as arguments)."""
    return (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)


def rebuild(tensors: tuple, like: Batch) -> Batch:
    """The inverse of `tensors_of`: a lone tensor again if `like` was one."""
    return tensors[0] if isinstance(like, torch.Tensor) else tuple(tensors)
