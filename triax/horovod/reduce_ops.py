"""Horovod's reduction operations and how each maps onto torch.distributed.

Average is a Sum followed by a division (gloo's AVG does not cover integers, and the divisor must
count only ranks that have not joined); Adasum has no torch.distributed equivalent (adasum.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from triax.horovod.errors import HorovodValueError

Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


def resolve(op: int | None, average: bool | None = None) -> int:
    """Horovod's (average=, op=) pair -> one op; `average` is the pre-0.21 spelling."""
    if average is not None and op is not None:
        raise HorovodValueError("pass either average= or op= to a Horovod collective, not both; use op=hvd.Average")
    if op is None:
        return Average if average is None or average else Sum
    if op not in _TORCH_OPS and op != Adasum:
        raise HorovodValueError(f"unknown reduction op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


def torch_op(op: int):
    return _TORCH_OPS[op]


def neutral_fill(tensor: torch.Tensor, op: int) -> torch.Tensor:
    """Fill with the value that leaves the reduction unchanged: what a joined rank contributes."""
    if op == Product:
        return tensor.fill_(1)
    if op in (Min, Max):
        info = torch.finfo(tensor.dtype) if tensor.is_floating_point() else torch.iinfo(tensor.dtype)
        return tensor.fill_(info.max if op == Min else info.min)
    return tensor.zero_()


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place by a float; integers round toward zero as Horovod's scaling does."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.mul_(factor)
    return tensor.copy_((tensor.double() * factor).to(tensor.dtype))
