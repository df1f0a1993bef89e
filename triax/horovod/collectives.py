"""Horovod's collectives: synchronous, `_async` (a handle for poll/synchronize) and in-place `_`.

Every function accepts Horovod's `name=` (used in error messages) and `process_set=` (a set
registered with hvd.init(process_sets=...) or hvd.add_process_set; see process_sets.py). Out-of-place synchronous forms go through autograd functions so gradients flow.
"""

from __future__ import annotations

from typing import Callable

import torch

from triax.horovod.errors import HorovodTypeError, HorovodValueError
from triax.horovod import autograd, basics, engine, handles, process_sets, reduce_ops
from triax.horovod.process_sets import ProcessSet, global_process_set, in_process_set
from triax.horovod.compression import Compression, Compressor

poll = handles.poll
synchronize = handles.synchronize


def _tensor(value: object, what: str) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise HorovodTypeError(f"hvd.{what} takes a torch.Tensor, got {type(value).__name__}; "
                         "wrap the value with torch.tensor(...)")
    basics.world()  # raises a clear error before init()
    return value


def _inplace(tensor: torch.Tensor, start: Callable[[torch.Tensor], tuple]):
    """Run `start(buffer)` on a contiguous buffer and copy the result back into `tensor`."""
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    works, finish = start(buffer)

    def done():
        result = finish()
        if result.data_ptr() != tensor.data_ptr():
            tensor.copy_(result)
        return tensor

    return works, done


# ---- allreduce -------------------------------------------------------------------------------
@in_process_set
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set):
    op = reduce_ops.resolve(op, average)
    return autograd.AllreduceFunction.apply(_tensor(tensor, "allreduce"), op, prescale_factor,
                                            postscale_factor, compression, name)


@in_process_set
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    compression: type[Compressor] = Compression.none, op: int | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set):
    op = reduce_ops.resolve(op, average)
    buffer = _tensor(tensor, "allreduce_async").detach().clone(memory_format=torch.contiguous_format)
    return handles.submit(lambda: engine.start_allreduce(buffer, op, prescale_factor, postscale_factor,
                                                         compression, name), name)


@in_process_set
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set):
    op = reduce_ops.resolve(op, average)
    tensor = _tensor(tensor, "allreduce_async_")
    return handles.submit(lambda: _inplace(tensor, lambda b: engine.start_allreduce(
        b, op, prescale_factor, postscale_factor, name=name)), name)


@in_process_set
def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


# ---- grouped allreduce (one fused allreduce per dtype) ----------------------------------------
def _tensors(values: object, what: str):
    if not isinstance(values, (list, tuple)) or not values:
        raise HorovodTypeError(f"hvd.{what} takes a non-empty list of tensors, got {type(values).__name__}")
    return [_tensor(v, what) for v in values]


@in_process_set
def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set):
    op = reduce_ops.resolve(op, average)
    return list(autograd.GroupedAllreduceFunction.apply(
        op, prescale_factor, postscale_factor, compression, name,
        *_tensors(tensors, "grouped_allreduce")))


@in_process_set
def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                            compression: type[Compressor] = Compression.none, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set):
    op = reduce_ops.resolve(op, average)
    buffers = [t.detach().clone(memory_format=torch.contiguous_format)
               for t in _tensors(tensors, "grouped_allreduce_async")]
    return handles.submit(lambda: engine.start_grouped_allreduce(buffers, op, prescale_factor, postscale_factor,
                                                                 compression, name), name)


@in_process_set
def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set):
    op = reduce_ops.resolve(op, average)
    tensors = _tensors(tensors, "grouped_allreduce_async_")
    buffers = [t if t.is_contiguous() else t.contiguous() for t in tensors]

    def start():
        works, finish = engine.start_grouped_allreduce(buffers, op, prescale_factor, postscale_factor,
                                                       name=name)

        def done():
            finish()
            for tensor, buffer in zip(tensors, buffers):
                if buffer.data_ptr() != tensor.data_ptr():
                    tensor.copy_(buffer)
            return tensors

        return works, done

    return handles.submit(start, name)


@in_process_set
def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ---- allgather --------------------------------------------------------------------------------
@in_process_set
def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set):
    return autograd.AllgatherFunction.apply(_tensor(tensor, "allgather"), name)


@in_process_set
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set):
    tensor = _tensor(tensor, "allgather_async").detach()
    return handles.submit(lambda: engine.start_allgather(tensor, name), name)


@in_process_set
def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set):
    return [allgather(t, name, process_set) for t in _tensors(tensors, "grouped_allgather")]


def _start_each(starts: list[Callable[[], tuple]]):
    """Start several operations under one handle: (all their works, finish giving the list of results)."""
    started = [start() for start in starts]
    return [work for works, _ in started for work in works], lambda: [finish() for _, finish in started]


@in_process_set
def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set):
    """One handle for the allgather of every tensor; synchronize() gives the list of results."""
    tensors = [t.detach() for t in _tensors(tensors, "grouped_allgather_async")]
    return handles.submit(lambda: _start_each([lambda t=t: engine.start_allgather(t, name) for t in tensors]),
                          name)


# ---- sparse allreduce: every rank's (indices, values), gathered ---------------------------------
@in_process_set
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: int = reduce_ops.Average,
                           process_set: ProcessSet = global_process_set):
    """Sum (or average) sparse COO tensors by gathering every rank's indices and values.

    Returns a function, as Horovod's does: calling it waits and gives an uncoalesced sparse tensor
    of the same size (coalesce() it to add up entries several ranks share).
    """
    if not torch.is_tensor(tensor) or not tensor.is_sparse:
        raise HorovodTypeError(f"hvd.sparse_allreduce_async takes a sparse COO tensor, got "
                               f"{type(tensor).__name__ if not torch.is_tensor(tensor) else tensor.layout}")
    op = reduce_ops.resolve(op)
    if op not in (reduce_ops.Average, reduce_ops.Sum):
        raise HorovodValueError(f"sparse allreduce supports op=hvd.Sum and hvd.Average, not {reduce_ops.NAMES[op]}")
    indices, values = tensor._indices(), tensor._values()
    if op == reduce_ops.Average:
        values = values / process_sets.active_size()
    # allgather concatenates along dim 0: gather the indices as (nnz, sparse_dims) rows.
    indices, values = indices.t().contiguous(), values.detach().contiguous()
    label = name or "sparse"
    index_handle = handles.submit(lambda: engine.start_allgather(indices, f"{label}.indices"),
                                  name and f"{name}.indices")
    value_handle = handles.submit(lambda: engine.start_allgather(values, f"{label}.values"),
                                  name and f"{name}.values")
    shape = tensor.shape

    def result():
        return torch.sparse_coo_tensor(synchronize(index_handle).t(), synchronize(value_handle), shape)

    return result


# ---- broadcast --------------------------------------------------------------------------------
@in_process_set
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set):
    return autograd.BroadcastFunction.apply(_tensor(tensor, "broadcast"), root_rank, name)


@in_process_set
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set):
    buffer = _tensor(tensor, "broadcast_async").detach().clone(memory_format=torch.contiguous_format)
    return handles.submit(lambda: engine.start_broadcast(buffer, root_rank, name), name)


@in_process_set
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set):
    tensor = _tensor(tensor, "broadcast_async_")
    return handles.submit(lambda: _inplace(tensor, lambda b: engine.start_broadcast(b, root_rank, name)), name)


@in_process_set
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall ---------------------------------------------------------------------------------
@in_process_set
def alltoall(tensor: torch.Tensor, splits: torch.Tensor | list[int] | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Returns the received tensor; with `splits`, also how many rows came from each rank."""
    output, received = autograd.AlltoallFunction.apply(_tensor(tensor, "alltoall"), splits, name)
    return output if splits is None else (output, received)


@in_process_set
def alltoall_async(tensor: torch.Tensor, splits: torch.Tensor | list[int] | None = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set):
    tensor = _tensor(tensor, "alltoall_async").detach()

    def start():
        works, finish = engine.start_alltoall(tensor, splits, name)
        return works, (finish if splits is not None else (lambda: finish()[0]))

    return handles.submit(start, name)


# ---- reducescatter ----------------------------------------------------------------------------
@in_process_set
def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none,
                  op: int = reduce_ops.Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    op = reduce_ops.resolve(op)
    return autograd.ReducescatterFunction.apply(_tensor(tensor, "reducescatter"), op, prescale_factor,
                                                postscale_factor, compression, name)


@in_process_set
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = reduce_ops.Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, compression: type[Compressor] = Compression.none):
    # Horovod's positional order (name, op, ...); `compression` is triax's, by keyword only.
    op = reduce_ops.resolve(op)
    tensor = _tensor(tensor, "reducescatter_async").detach()
    return handles.submit(lambda: engine.start_reducescatter(tensor, op, prescale_factor, postscale_factor,
                                                             compression, name), name)


@in_process_set
def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: int = reduce_ops.Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0):
    """One handle for the reducescatter of every tensor (Horovod's signature: no compression)."""
    op = reduce_ops.resolve(op)
    tensors = [t.detach() for t in _tensors(tensors, "grouped_reducescatter_async")]
    return handles.submit(lambda: _start_each([
        lambda t=t: engine.start_reducescatter(t, op, prescale_factor, postscale_factor, name=name)
        for t in tensors]), name)


@in_process_set
def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: int = reduce_ops.Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0):
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor)
            for t in _tensors(tensors, "grouped_reducescatter")]


# ---- barrier ----------------------------------------------------------------------------------
@in_process_set
def barrier(process_set: ProcessSet = global_process_set):
    basics.world()
    engine.wait(engine.start_barrier())
