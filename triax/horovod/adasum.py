"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", 2021).

Two gradients a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is a + b when they are orthogonal and their average when they are parallel. Over 2^k ranks
the combination runs as a butterfly: at step d (1, 2, 4, ...) each rank swaps its current vector
with rank XOR d and both compute adasum(lower rank's, higher rank's), so after log2(size) steps
every rank holds the same result. Only point-to-point sends of one tensor are needed; no rank
ever holds more than two copies. Like Horovod, only power-of-two numbers of ranks are supported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from triax.horovod import process_sets
from triax.horovod.errors import HorovodNotImplementedError


def power_of_two_problem(size: int) -> str | None:
    if size & (size - 1):
        return (f"op=hvd.Adasum needs a power-of-two number of ranks, got {size}; run on 1, 2, 4, 8, ... "
                "processes (or a process set of that size), or use op=hvd.Average")
    return None


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """adasum(a, b); the dot products in float64 so the coefficients do not depend on the dtype."""
    a64, b64 = a.double(), b.double()
    dot = torch.dot(a64.reshape(-1), b64.reshape(-1))
    a_norm, b_norm = a64.square().sum(), b64.square().sum()
    a_scale = 1 - dot / (2 * a_norm) if a_norm > 0 else torch.ones((), dtype=torch.float64)
    b_scale = 1 - dot / (2 * b_norm) if b_norm > 0 else torch.ones((), dtype=torch.float64)
    return (a_scale * a64 + b_scale * b64).to(a.dtype)


def adasum_(tensor: torch.Tensor) -> torch.Tensor:
    """Replace `tensor` (contiguous, floating) with the Adasum of every rank's, in the active set."""
    size, me, ranks = process_sets.active_size(), process_sets.active_rank(), process_sets.active_ranks()
    problem = power_of_two_problem(size)
    if problem:
        raise HorovodNotImplementedError(problem)
    group = process_sets.active_group()
    current = tensor.detach().clone()
    distance = 1
    while distance < size:
        partner = me ^ distance
        received = torch.empty_like(current)
        works = [dist.isend(current, ranks[partner], group=group), dist.irecv(received, ranks[partner], group=group)]
        for work in works:
            work.wait()
        lower, higher = (current, received) if me < partner else (received, current)
        current = combine(lower, higher)
        distance *= 2
    tensor.copy_(current)
    return tensor
