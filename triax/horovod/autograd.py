"""Autograd functions: the out-of-place collectives carry gradients, as Horovod's do.

The backward of each collective is the collective that routes gradients back to where the inputs
came from: allreduce -> allreduce, allgather -> allreduce then this rank's rows, broadcast ->
allreduce kept on the root, alltoall -> alltoall with the received splits, reducescatter -> allgather
(times the number of ranks for op=Sum). Gradients are averaged across ranks where Horovod averages
them (allgather, broadcast). Each matches the gradient tests of Horovod's own suite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triax.horovod.errors import HorovodValueError
from triax.horovod import basics, engine, process_sets, reduce_ops
from triax.horovod.compression import Compressor

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone(memory_format=torch.contiguous_format)


class AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                compression: type[Compressor], name: str | None):
        ctx.process_set = process_sets.current()
        ctx.args = (op, prescale, postscale, compression, name)
        return engine.wait(engine.start_allreduce(_own_copy(tensor), op, prescale, postscale,
                                                  compression, name))

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        with process_sets.scoped(ctx.process_set):
            return AllreduceFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: FunctionCtx, grad: torch.Tensor):
        op, prescale, postscale, compression, name = ctx.args
        if op not in (reduce_ops.Average, reduce_ops.Sum):
            raise HorovodValueError(f"allreduce {name or ''}: no gradient for op={reduce_ops.NAMES[op]}; "
                             "only Average and Sum are differentiable")
        return (engine.wait(engine.start_allreduce(_own_copy(grad), op, prescale, postscale,
                                                   compression, name)), None, None, None, None, None)


class GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, op: int, prescale: float, postscale: float, compression: type[Compressor],
                name: str | None, *tensors: torch.Tensor):
        ctx.process_set = process_sets.current()
        ctx.args = (op, prescale, postscale, compression, name)
        buffers = [_own_copy(t) for t in tensors]
        return tuple(engine.wait(engine.start_grouped_allreduce(buffers, op, prescale, postscale,
                                                                compression, name)))

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor):
        with process_sets.scoped(ctx.process_set):
            return GroupedAllreduceFunction._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx: FunctionCtx, *grads: torch.Tensor):
        op, prescale, postscale, compression, name = ctx.args
        if op not in (reduce_ops.Average, reduce_ops.Sum):
            raise HorovodValueError(f"grouped_allreduce {name or ''}: no gradient for op={reduce_ops.NAMES[op]}")
        buffers = [_own_copy(g) for g in grads]
        reduced = engine.wait(engine.start_grouped_allreduce(buffers, op, prescale, postscale,
                                                             compression, name))
        return (None, None, None, None, None, *reduced)


class AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, name: str | None):
        ctx.process_set = process_sets.current()
        ctx.rows, ctx.name = tensor.shape[0], name
        return engine.wait(engine.start_allgather(tensor.detach(), name))

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        with process_sets.scoped(ctx.process_set):
            return AllgatherFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: FunctionCtx, grad: torch.Tensor):
        reduced = engine.wait(engine.start_allreduce(_own_copy(grad), reduce_ops.Average, name=ctx.name))
        # Where this rank's rows sit in the output: after the rows of lower ranks.
        rows = engine.wait(engine.start_allgather(torch.tensor([ctx.rows]), name=ctx.name))
        offset = int(rows[:process_sets.active_rank()].sum())
        return reduced[offset:offset + ctx.rows], None


class BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, root_rank: int, name: str | None):
        ctx.process_set = process_sets.current()
        ctx.root_rank, ctx.name = root_rank, name
        return engine.wait(engine.start_broadcast(_own_copy(tensor), root_rank, name))

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        with process_sets.scoped(ctx.process_set):
            return BroadcastFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: FunctionCtx, grad: torch.Tensor):
        reduced = engine.wait(engine.start_allreduce(_own_copy(grad), reduce_ops.Average, name=ctx.name))
        if basics.rank() != ctx.root_rank:
            reduced.zero_()  # only the root's input reached the output
        return reduced, None, None


class AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, splits: torch.Tensor | list[int] | None, name: str | None):
        ctx.process_set = process_sets.current()
        ctx.name = name
        output, received = engine.wait(engine.start_alltoall(tensor.detach(), splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor, _received_grad: torch.Tensor):
        with process_sets.scoped(ctx.process_set):
            return AlltoallFunction._backward(ctx, grad, _received_grad)

    @staticmethod
    def _backward(ctx: FunctionCtx, grad: torch.Tensor, _received_grad: torch.Tensor):
        back, _ = engine.wait(engine.start_alltoall(grad.contiguous(), ctx.received, ctx.name))
        return back, None, None


class ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                compression: type[Compressor], name: str | None):
        ctx.process_set = process_sets.current()
        ctx.args = (op, prescale, postscale, name)
        return engine.wait(engine.start_reducescatter(tensor.detach(), op, prescale, postscale,
                                                      compression, name))

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        with process_sets.scoped(ctx.process_set):
            return ReducescatterFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: FunctionCtx, grad: torch.Tensor):
        op, prescale, postscale, name = ctx.args
        if op not in (reduce_ops.Average, reduce_ops.Sum):
            raise HorovodValueError(f"reducescatter {name or ''}: no gradient for op={reduce_ops.NAMES[op]}")
        # Horovod's definition: the gathered gradient, times the number of ranks for Sum (each
        # rank's input reached every rank's sum) and once for Average; then the scale factors.
        gathered = engine.wait(engine.start_allgather(grad.contiguous(), name))
        factor = prescale * postscale * (process_sets.active_size() if op == reduce_ops.Sum else 1)
        return reduce_ops.scale_(gathered.clone(), factor), None, None, None, None, None


