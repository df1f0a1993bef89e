"""The collectives themselves, on torch.distributed, without autograd.

Each `start_*` runs the disagreement check, launches the torch.distributed op asynchronously and
returns `(works, finish)`: wait on `works`, then `finish()` gives the result. The public functions
(collectives.py) wrap this as synchronous calls, `_async` handles and autograd functions.
`agreement` is passed by joining.py when a joined rank replays a collective it has already checked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from triax.errors import TriaxError
from triax.horovod import basics, check, compat, reduce_ops
from triax.horovod.compression import NoneCompressor

_UNCHECKED = object()  # sentinel: run the check here


def wait(works_and_finish):
    works, finish = works_and_finish
    for work in works:
        work.wait()
    return finish()


def _agree(agreement, kind, tensor=None, **fields):
    return check.agree(kind, tensor, **fields) if agreement is _UNCHECKED else agreement


def _distributed() -> bool:
    return basics.size() > 1


def start_allreduce(buffer: torch.Tensor, op: int, prescale: float = 1.0, postscale: float = 1.0,
                    compression=NoneCompressor, name: str | None = None, extra: str = "",
                    agreement=_UNCHECKED):
    """Reduce `buffer` (contiguous) in place across ranks."""
    if not buffer.is_contiguous():  # callers hand over their own contiguous copy
        raise RuntimeError(f"allreduce {name or ''}: internal buffer must be contiguous")
    wire, ctx = compression.compress(buffer)
    # The check describes the tensor as it travels (a joined rank must send the same dtype);
    # the extra digest keeps the caller's own shape and dtype in the comparison.
    agreement = _agree(agreement, "allreduce", wire, op=op, name=name,
                       extra=f"{extra}|{buffer.dtype}")
    contributors = agreement.active_count if agreement is not None else basics.size()
    if op == reduce_ops.Average:
        postscale = postscale / contributors
    reduce_ops.scale_(wire, prescale)
    works = [dist.all_reduce(wire, op=reduce_ops.torch_op(op), async_op=True)] if _distributed() else []

    def finish():
        reduce_ops.scale_(wire, postscale)
        result = compression.decompress(wire, ctx)
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)
        return buffer

    return works, finish


def start_grouped_allreduce(buffers: list[torch.Tensor], op: int, prescale: float = 1.0,
                            postscale: float = 1.0, compression=NoneCompressor,
                            name: str | None = None):
    """Reduce several tensors in place with one fused allreduce per (dtype, device)."""
    groups: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(buffers):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    works, finishes = [], []
    for indices in groups.values():
        flat = torch.cat([buffers[i].reshape(-1) for i in indices])
        shapes = ";".join(str(tuple(buffers[i].shape)) for i in indices)
        group_works, group_finish = start_allreduce(flat, op, prescale, postscale, compression,
                                                    name, extra=shapes)
        works += group_works

        def finish(flat=flat, indices=indices, group_finish=group_finish):
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


def start_allgather(tensor: torch.Tensor, name: str | None = None, agreement=_UNCHECKED):
    """Concatenate every rank's tensor along dim 0; first dimensions may differ."""
    tensor = tensor.contiguous()
    if not _distributed():
        return [], lambda: tensor.clone()
    if tensor.dim() == 0:
        raise TriaxError(f"allgather {name or ''}: a 0-dim tensor has no first dimension to "
                         "concatenate along; use tensor.reshape(1)")
    agreement = _agree(agreement, "allgather", tensor, name=name)
    if agreement is not None:
        first_dims = agreement.first_dims()
    else:
        dims = torch.empty(basics.size(), dtype=torch.int64)
        compat.all_gather_single(dims, torch.tensor([tensor.shape[0]], dtype=torch.int64))
        first_dims = dims.tolist()
    longest, rest = max(first_dims), tuple(tensor.shape[1:])
    if tensor.shape[0] < longest:  # pad so every rank sends the same number of rows
        padded = tensor.new_zeros((longest,) + rest)
        padded[:tensor.shape[0]] = tensor
    else:
        padded = tensor
    gathered = tensor.new_empty((longest * len(first_dims),) + rest)
    works = [compat.all_gather_single(gathered, padded, async_op=True)]

    def finish():
        if all(d == longest for d in first_dims):
            return gathered
        return torch.cat([gathered[r * longest:r * longest + d] for r, d in enumerate(first_dims)])

    return works, finish


def start_broadcast(buffer: torch.Tensor, root_rank: int, name: str | None = None,
                    agreement=_UNCHECKED):
    """Overwrite `buffer` (contiguous) with root_rank's."""
    size = basics.size()
    if not 0 <= root_rank < size:
        raise TriaxError(f"broadcast {name or ''}: root_rank={root_rank} is outside 0..{size - 1}")
    if not _distributed():
        return [], lambda: buffer
    _agree(agreement, "broadcast", buffer, root=root_rank, name=name)
    works = [dist.broadcast(buffer, src=root_rank, async_op=True)]
    return works, lambda: buffer


def even_splits(rows: int, parts: int) -> list[int]:
    """Horovod's split of `rows` into `parts`: earlier parts take the remainder."""
    return [rows // parts + (1 if r < rows % parts else 0) for r in range(parts)]


def start_alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
                   agreement=_UNCHECKED):
    """Send rows splits[r] to rank r; returns (received rows, received splits)."""
    size = basics.size()
    tensor = tensor.contiguous()
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % size:
            raise TriaxError(f"alltoall {name or ''}: first dimension {tuple(tensor.shape)[:1]} does "
                             f"not divide by size {size}; pass splits= (rows sent to each rank)")
        splits = [tensor.shape[0] // size] * size
    splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != tensor.shape[0]:
        raise TriaxError(f"alltoall {name or ''}: splits={splits} must have {size} non-negative "
                         f"entries summing to the first dimension {tensor.shape[0] if tensor.dim() else 0}")
    if not _distributed():
        return [], lambda: (tensor.clone(), torch.tensor(splits, dtype=torch.int32))
    _agree(agreement, "alltoall", tensor, name=name)
    received = torch.empty(size, dtype=torch.int64)
    dist.all_to_all_single(received, torch.tensor(splits, dtype=torch.int64))
    received_splits = received.tolist()
    output = tensor.new_empty((sum(received_splits),) + tuple(tensor.shape[1:]))
    works = [dist.all_to_all_single(output, tensor, output_split_sizes=received_splits,
                                    input_split_sizes=splits, async_op=True)]
    return works, lambda: (output, received.to(torch.int32))


def start_reducescatter(tensor: torch.Tensor, op: int = reduce_ops.Average, prescale: float = 1.0,
                        postscale: float = 1.0, compression=NoneCompressor, name: str | None = None,
                        agreement=_UNCHECKED):
    """Reduce across ranks, each keeping its share of dim 0 (Horovod's uneven split)."""
    size, rank = basics.size(), basics.rank()
    if tensor.dim() == 0:
        raise TriaxError(f"reducescatter {name or ''}: a 0-dim tensor cannot be scattered; reshape it")
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
    contributors = agreement.active_count if agreement is not None else size
    if op == reduce_ops.Average:
        postscale = postscale / contributors
    reduce_ops.scale_(wire, prescale)
    output = wire.new_empty((chunk,) + rest)
    if _distributed():
        works = [compat.reduce_scatter_single(output, wire, op=reduce_ops.torch_op(op), async_op=True)]
    else:
        works, output = [], wire

    def finish():
        reduce_ops.scale_(output, postscale)
        return compression.decompress(output, ctx)[:shares[rank]]

    return works, finish


def start_barrier(agreement=_UNCHECKED):
    if not _distributed():
        return [], lambda: None
    _agree(agreement, "barrier")
    return [dist.barrier(async_op=True)], lambda: None
