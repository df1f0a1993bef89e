"""The collectives themselves, on torch.distributed, without autograd.

Each `start_*` runs the disagreement check, launches the torch.distributed op asynchronously and
returns `(works, finish)`: wait on `works`, then `finish()` gives the result. The public functions
(collectives.py) wrap this as synchronous calls, `_async` handles and autograd functions.
`agreement` is passed by joining.py when a joined rank replays a collective it has already checked.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from triax.horovod.errors import HorovodInternalError, HorovodNotImplementedError, HorovodValueError
from triax.horovod import adasum, check, compat, handles, process_sets, reduce_ops
from triax.horovod.handles import wait_all
from triax.horovod.compression import Compressor, NoneCompressor

_UNCHECKED = object()  # sentinel: run the check here


def wait(works_and_finish: tuple[list, Callable[[], Any]]):
    works, finish = works_and_finish
    wait_all(works)
    return finish()


def _agree(agreement: object, kind: str, tensor: torch.Tensor | None = None, problem: str | None = None,
           problem_class: type[Exception] = HorovodInternalError, **fields: Any):
    """The check round (or the one a joined rank already did); a `problem` raises on every rank."""
    if agreement is _UNCHECKED:
        return check.agree(kind, tensor, problem=problem, problem_class=problem_class, **fields)
    if problem:
        raise problem_class(problem)
    return agreement


def _distributed() -> bool:
    return process_sets.active_size() > 1


def _group():
    return process_sets.active_group()


# dtypes gloo (and NCCL) cannot move, and the wider type they travel as. Integers widen and narrow
# back bit-exactly: a sum that overflows int16 wraps exactly as it would have in int16.
_WIRE_DTYPES = {torch.int16: torch.int32}


def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    wider = _WIRE_DTYPES.get(tensor.dtype)
    return tensor if wider is None else tensor.to(wider)


def _average_divisor(tensor: torch.Tensor, op: int, contributors: int, postscale: float):
    """Horovod averages floats by scaling and integers by division rounded toward zero (its scaling
    casts the product back to the integer type): (divisor, postscale)."""
    if op != reduce_ops.Average:
        return 1, postscale
    if tensor.is_floating_point() or tensor.is_complex():
        return 1, postscale / contributors
    return contributors, postscale


def start_allreduce(buffer: torch.Tensor, op: int, prescale: float = 1.0, postscale: float = 1.0,
                    compression: type[Compressor] = NoneCompressor, name: str | None = None, extra: str = "",
                    agreement: object = _UNCHECKED):
    """Reduce `buffer` (contiguous) in place across ranks."""
    if not buffer.is_contiguous():  # callers hand over their own contiguous copy
        raise RuntimeError(f"allreduce {name or ''}: internal buffer must be contiguous")
    if op == reduce_ops.Adasum:
        return _start_adasum(buffer, prescale, postscale, compression, name, extra, agreement)
    wire, ctx = compression.compress(buffer)
    # The check describes the tensor as it travels (a joined rank must send the same dtype);
    # the extra digest keeps the caller's own shape and dtype in the comparison.
    agreement = _agree(agreement, "allreduce", wire, op=op, name=name,
                       extra=f"{extra}|{buffer.dtype}")
    # Horovod averages over the whole set, joined ranks included (they contribute zeros).
    divisor, postscale = _average_divisor(wire, op, process_sets.active_size(), postscale)
    reduce_ops.scale_(wire, prescale)
    sent = to_wire(wire)
    works = [dist.all_reduce(sent, op=reduce_ops.torch_op(op), group=_group(), async_op=True)] if _distributed() else []

    def finish():
        if divisor != 1:
            sent.div_(divisor, rounding_mode="trunc")
        reduce_ops.scale_(sent, postscale)
        if sent is not wire:
            wire.copy_(sent)
        result = compression.decompress(wire, ctx)
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)
        return buffer

    return works, finish


def _start_adasum(buffer: torch.Tensor, prescale: float, postscale: float, compression: type[Compressor],
                  name: str | None, extra: str, agreement: object):
    """Adasum runs to completion here (a butterfly of sends, see adasum.py); nothing stays in flight."""
    size_problem = adasum.power_of_two_problem(process_sets.active_size())
    if size_problem:  # the same size on every rank of the set: all raise here, Horovod's class
        raise HorovodNotImplementedError(size_problem)
    problem = None
    if not buffer.is_floating_point():
        problem = f"allreduce {name or ''}: op=hvd.Adasum combines floating-point gradients, got {buffer.dtype}"
    wire, ctx = compression.compress(buffer)
    agreement = _agree(agreement, "allreduce", wire, problem, op=reduce_ops.Adasum, name=name,
                       extra=f"{extra}|{buffer.dtype}")
    if agreement is not None and agreement.joined:
        raise HorovodInternalError(f"allreduce {name or ''}: op=hvd.Adasum cannot run while ranks "
                                   f"{agreement.joined} have joined")
    reduce_ops.scale_(wire, prescale)
    if _distributed():
        adasum.adasum_(wire)
    reduce_ops.scale_(wire, postscale)
    result = compression.decompress(wire, ctx)
    if result.data_ptr() != buffer.data_ptr():
        buffer.copy_(result)
    return [], lambda: buffer


def start_grouped_allreduce(buffers: list[torch.Tensor], op: int, prescale: float = 1.0,
                            postscale: float = 1.0, compression: type[Compressor] = NoneCompressor,
                            name: str | None = None):
    """Reduce several tensors in place with one fused allreduce per (dtype, device)."""
    groups: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(buffers):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    works, finishes = [], []
    if op == reduce_ops.Adasum:  # Adasum combines each tensor on its own, as Horovod's does
        groups = {(i,): [i] for i in range(len(buffers))}
    for indices in groups.values():
        flat = torch.cat([buffers[i].reshape(-1) for i in indices])
        shapes = ";".join(str(tuple(buffers[i].shape)) for i in indices)
        group_works, group_finish = start_allreduce(flat, op, prescale, postscale, compression,
                                                    name, extra=shapes)
        works += group_works

        def finish(flat: torch.Tensor = flat, indices: list[int] = indices,
                   group_finish: Callable[[], Any] = group_finish):
            group_finish()
            offset = 0
            for i in indices:
                count = buffers[i].numel()
                buffers[i].copy_(flat[offset:offset + count].view_as(buffers[i]))
                offset += count

        finishes.append(finish)

    def finish_all():
        for finish in finishes:
            finish()
        return buffers

    return works, finish_all


def start_allgather(tensor: torch.Tensor, name: str | None = None, agreement: object = _UNCHECKED):
    """Concatenate every rank's tensor along dim 0; first dimensions may differ."""
    tensor = tensor.contiguous()
    problem = (f"allgather {name or ''}: a 0-dim tensor has no first dimension to concatenate along; "
               "use tensor.reshape(1)") if tensor.dim() == 0 else None
    agreement = _agree(agreement, "allgather", tensor, problem, name=name)
    if not _distributed():
        return [], lambda: tensor.clone()
    if agreement is not None:
        first_dims = agreement.first_dims()
    else:
        dims = torch.empty(process_sets.active_size(), dtype=torch.int64)
        compat.all_gather_single(dims, torch.tensor([tensor.shape[0]], dtype=torch.int64), group=_group())
        first_dims = dims.tolist()
    longest, rest = max(first_dims), tuple(tensor.shape[1:])
    sent = to_wire(tensor)
    if tensor.shape[0] < longest:  # pad so every rank sends the same number of rows
        padded = sent.new_zeros((longest,) + rest)
        padded[:tensor.shape[0]] = sent
    else:
        padded = sent
    gathered = sent.new_empty((longest * len(first_dims),) + rest)
    works = [compat.all_gather_single(gathered, padded, group=_group(), async_op=True)]

    def finish():
        rows = gathered
        if any(d != longest for d in first_dims):
            rows = torch.cat([gathered[r * longest:r * longest + d] for r, d in enumerate(first_dims)])
        return rows if rows.dtype == tensor.dtype else rows.to(tensor.dtype)

    return works, finish


def start_broadcast(buffer: torch.Tensor, root_rank: int, name: str | None = None,
                    agreement: object = _UNCHECKED):
    """Overwrite `buffer` (contiguous) with root_rank's."""
    problem = root_problem("broadcast", root_rank, name)
    _agree(agreement, "broadcast", buffer, problem, root=root_rank if problem is None else -1, name=name)
    if not _distributed():
        return [], lambda: buffer
    sent = to_wire(buffer)
    works = [dist.broadcast(sent, src=root_rank, group=_group(), async_op=True)]

    def finish():
        if sent is not buffer:
            buffer.copy_(sent)
        return buffer

    return works, finish


def root_problem(what: str, root_rank: int, name: str | None) -> str | None:
    ranks = process_sets.active_ranks()  # root_rank is a global rank, in the set (as Horovod's)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in ranks:
        where = f"0..{len(ranks) - 1}" if process_sets.current().ranks is None else f"the process set {ranks}"
        return f"{what} {name or ''}: root_rank={root_rank!r} is not a rank in {where}"
    return None


def even_splits(rows: int, parts: int) -> list[int]:
    """Horovod's split of `rows` into `parts`: earlier parts take the remainder."""
    return [rows // parts + (1 if r < rows % parts else 0) for r in range(parts)]


def _checked_splits(tensor: torch.Tensor, splits: torch.Tensor | list[int] | None, size: int, name: str | None):
    """(rows sent to each rank, None) or (None, what is wrong)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if tensor.dim() == 0 or rows % size:
            return None, (f"alltoall {name or ''}: first dimension {tuple(tensor.shape)[:1]} does not divide "
                          f"by size {size}; pass splits= (rows sent to each rank)")
        return [rows // size] * size, None
    if torch.is_tensor(splits) and splits.dtype != torch.int32:  # Horovod's rule for a splits tensor
        return None, f"alltoall {name or ''}: splits must be a tensor of int32, got {splits.dtype}"
    try:
        splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    except (TypeError, ValueError):
        return None, f"alltoall {name or ''}: splits={splits!r} is not a list of row counts"
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
        return None, (f"alltoall {name or ''}: splits={splits} must have {size} non-negative entries "
                      f"summing to the first dimension {rows}")
    return splits, None


def start_alltoall(tensor: torch.Tensor, splits: torch.Tensor | list[int] | None = None, name: str | None = None,
                   agreement: object = _UNCHECKED):
    """Send rows splits[r] to rank r; returns (received rows, received splits)."""
    size = process_sets.active_size()
    tensor = tensor.contiguous()
    splits, problem = _checked_splits(tensor, splits, size, name)
    # Bad splits are a ValueError in Horovod, raised on every rank here (see check.agree).
    _agree(agreement, "alltoall", tensor, problem, HorovodValueError, name=name)
    if not _distributed():
        return [], lambda: (tensor.clone(), torch.tensor(splits, dtype=torch.int32))
    received = torch.empty(size, dtype=torch.int64)
    handles.wait_one(dist.all_to_all_single(received, torch.tensor(splits, dtype=torch.int64), group=_group(), async_op=True))
    received_splits = received.tolist()
    sent = to_wire(tensor)
    output = sent.new_empty((sum(received_splits),) + tuple(tensor.shape[1:]))
    works = [dist.all_to_all_single(output, sent, output_split_sizes=received_splits,
                                    input_split_sizes=splits, group=_group(), async_op=True)]
    return works, lambda: (output.to(tensor.dtype), received.to(torch.int32))


def start_reducescatter(tensor: torch.Tensor, op: int = reduce_ops.Average, prescale: float = 1.0,
                        postscale: float = 1.0, compression: type[Compressor] = NoneCompressor, name: str | None = None,
                        agreement: object = _UNCHECKED):
    """Reduce across ranks, each keeping its share of dim 0 (Horovod's uneven split)."""
    size, rank = process_sets.active_size(), process_sets.active_rank()
    if op == reduce_ops.Adasum:  # as in Horovod
        _agree(agreement, "reducescatter", tensor, problem=f"reducescatter {name or ''}: op=hvd.Adasum is "
               "not supported for reducescatter; use op=hvd.Sum or hvd.Average")
    if tensor.dim() == 0:  # refused on every rank, before any data moves
        _agree(agreement, "reducescatter", tensor, problem=f"reducescatter {name or ''}: a 0-dim tensor "
               "cannot be scattered; reshape it to at least one dimension")
    shares = even_splits(tensor.shape[0], size)
    chunk, rest = max(shares), tuple(tensor.shape[1:])
    # Lay each rank's share into an equal-sized chunk, so reduce_scatter_tensor can do the work.
    padded = tensor.new_zeros((chunk * size,) + rest)
    offset = 0
    for r, share in enumerate(shares):
        padded[r * chunk:r * chunk + share] = tensor[offset:offset + share]
        offset += share
    wire, ctx = compression.compress(padded)
    agreement = _agree(agreement, "reducescatter", wire, op=op, name=name,
                       extra=f"{tuple(tensor.shape)}|{tensor.dtype}")
    divisor, postscale = _average_divisor(wire, op, size, postscale)
    reduce_ops.scale_(wire, prescale)
    sent = to_wire(wire)
    output = sent.new_empty((chunk,) + rest)
    if _distributed():
        works = [compat.reduce_scatter_single(output, sent, op=reduce_ops.torch_op(op), group=_group(),
                                              async_op=True)]
    else:
        works, output = [], sent

    def finish():
        if divisor != 1:
            output.div_(divisor, rounding_mode="trunc")
        reduce_ops.scale_(output, postscale)
        return compression.decompress(output.to(wire.dtype), ctx)[:shares[rank]]

    return works, finish


def start_barrier(agreement: object = _UNCHECKED):
    if not _distributed():
        return [], lambda: None
    _agree(agreement, "barrier")
    return [dist.barrier(group=_group(), async_op=True)], lambda: None
