"""Choosing `balance`: measure what each layer costs, then cut the layers into partitions.

A pipeline runs at the pace of its slowest partition. The two helpers differ in what they measure
per layer (see profile.py):

* `balance_by_time`: forward + backward time of each layer on a sample batch.
* `balance_by_size`: memory each layer holds during training — what autograd saves for
  backward on one micro-batch, plus its parameters times `param_scale` (2 for weights and
  gradients; more for optimizers that keep state, e.g. 4 for Adam).

By default the costs are cut as FairScale cuts them (`blockpartition.solve`: even to within one
layer's cost, not always the best cut), so a script gets the balance it got under FairScale.
`exact=True` returns instead the cut whose slowest partition is fastest (`balance_cost`).
Both measure copies of the layers, so the module passed in is left untouched.
"""

from __future__ import annotations

from typing import Callable, TYPE_CHECKING

import torch
from torch import nn

from triax.pipe.balance import blockpartition
from triax.pipe.balance.blockpartition import check_partitions
from triax.pipe.balance.profile import profile_sizes, profile_times
from triax.pipe.errors import PipeTypeError
from triax.pipe.microbatch import check_batch, coerce_chunks

if TYPE_CHECKING:
    from triax.pipe.microbatch import Batch

__all__ = ["balance_by_time", "balance_by_size", "balance_cost"]


def balance_cost(costs: list[float], partitions: int) -> list[int]:
    """Cut `costs` into `partitions` non-empty contiguous runs minimising the largest run's sum.

    Returns the length of each run. Among cuts with that smallest maximum, the most even one
    (least sum of squared run costs) is returned, so partitions other than the slowest are not
    needlessly lopsided. Exact: two dynamic programmes of O(partitions * n^2) over n layers.
    """
    layers = len(costs)
    check_partitions(partitions, layers)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    bound, _ = _best_cut(prefix, partitions, score=lambda cost: cost, combine=max)
    slack = 1e-9 * max(abs(bound), 1e-12)  # float sums of the same runs may differ in the last bit
    _, sizes = _best_cut(prefix, partitions,
                         score=lambda cost: cost * cost if cost <= bound + slack else float("inf"),
                         combine=lambda total, part: total + part)
    return sizes


def _best_cut(prefix: list[float], partitions: int, score: Callable[[float], float],
              combine: Callable[[float, float], float]) -> tuple[float, list[int]]:
    """The cut of the layers into contiguous partitions with the least `combine` of `score(run cost)`."""
    layers = len(prefix) - 1
    infinity = float("inf")
    # best[p][k]: the least value for the first k layers cut into p partitions;
    # last_start[p][k]: where the p-th partition starts in that cut.
    best = [[infinity] * (layers + 1) for _ in range(partitions + 1)]
    last_start = [[0] * (layers + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for part in range(1, partitions + 1):
        # Leave at least one layer for each of the partitions still to come.
        for end in range(part, layers - (partitions - part) + 1):
            for start in range(part - 1, end):
                candidate = combine(best[part - 1][start], score(prefix[end] - prefix[start]))
                if candidate < best[part][end]:
                    best[part][end] = candidate
                    last_start[part][end] = start
    sizes = []
    end = layers
    for part in range(partitions, 0, -1):
        start = last_start[part][end]
        sizes.append(end - start)
        end = start
    return best[partitions][layers], sizes[::-1]


def _cut(costs: list[float], partitions: int, exact: bool) -> list[int]:
    if exact:
        return balance_cost(costs, partitions)
    return [len(block) for block in blockpartition.solve(costs, partitions)]


def _check_module(module: object) -> None:
    if not isinstance(module, nn.Sequential):
        raise PipeTypeError(f"balancing needs the nn.Sequential you will give Pipe, got {type(module).__name__}")


def _default_device(device: torch.device | int | str | None) -> torch.device:
    # FairScale's default is 'cuda'; the CPU when no GPU is visible lets the same call run anywhere.
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def balance_by_time(partitions: int, module: nn.Sequential, sample: Batch, *, timeout: float = 1.0,
                    device: torch.device | int | str | None = None, exact: bool = False) -> list[int]:
    """A balance for `Pipe` that evens out forward + backward time per partition.

    `sample` is a batch like the ones the pipe will see (the micro-batch size matters). Layers are
    timed one at a time on `device` (default: the current GPU, else the CPU), repeating whole passes
    until `timeout` seconds are spent, after one untimed warm-up pass. `exact=True`: the cut whose
    slowest partition is fastest, instead of FairScale's block partition.
    """
    _check_module(module)
    check_partitions(partitions, len(module))
    check_batch(sample, "sample")
    times = profile_times(module, sample, timeout, _default_device(device))
    return _cut(times, partitions, exact)


def balance_by_size(partitions: int, module: nn.Sequential, input: Batch, *, chunks: int = 1, param_scale: float = 2.0,
                    device: torch.device | int | str | None = None, exact: bool = False) -> list[int]:
    """A balance for `Pipe` that evens out training memory per partition (FairScale's signature).

    Each layer's cost is the bytes autograd saves for its backward on one micro-batch (`input`
    cut into `chunks`) plus `param_scale` times its parameter bytes. `exact=True`: the cut whose
    largest partition is smallest, instead of FairScale's block partition.
    """
    _check_module(module)
    check_partitions(partitions, len(module))
    check_batch(input, "input")
    chunks = coerce_chunks(chunks)
    sizes = profile_sizes(module, input, chunks, param_scale, _default_device(device))
    return _cut(sizes, partitions, exact)
