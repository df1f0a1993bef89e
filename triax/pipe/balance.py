"""Choosing `balance`: measure what each layer costs, then cut so the slowest partition is fastest.

A pipeline runs at the pace of its slowest partition, so the best cut of n layers into p
contiguous partitions is the one whose largest partition cost is smallest. `balance_cost` finds
it exactly (dynamic programming over cut points); the two helpers only differ in what they
measure per layer:

* `balance_by_time`: forward + backward time of each layer on a sample batch.
* `balance_by_size`: memory each layer holds during training — what autograd saves for
  backward on one micro-batch, plus its parameters times `param_scale` (2 for weights and
  gradients; more for optimizers that keep state, e.g. 4 for Adam).

Both run on a copy of the module, so the module passed in is left untouched.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from triax.pipe.errors import PipeTypeError, PipeValueError
from triax.pipe.microbatch import check_batch, coerce_chunks, split, tensors_of, to_device


def balance_cost(costs: list[float], partitions: int) -> list[int]:
    """Cut `costs` into `partitions` non-empty contiguous runs minimising the largest run's sum.

    Returns the length of each run. Among cuts with that smallest maximum, the most even one
    (least sum of squared run costs) is returned, so partitions other than the slowest are not
    needlessly lopsided. Exact: two dynamic programmes of O(partitions * n^2) over n layers.
    """
    layers = len(costs)
    _check_partitions(partitions, layers)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    bound, _ = _best_cut(prefix, partitions, score=lambda cost: cost, combine=max)
    slack = 1e-9 * max(abs(bound), 1e-12)  # float sums of the same runs may differ in the last bit
    _, sizes = _best_cut(prefix, partitions,
                         score=lambda cost: cost * cost if cost <= bound + slack else float("inf"),
                         combine=lambda total, part: total + part)
    return sizes


def _best_cut(prefix: list[float], partitions: int, score, combine) -> tuple[float, list[int]]:
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


def _check_partitions(partitions, layers: int) -> None:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise PipeValueError(f"partitions must be a whole number >= 1, got {partitions!r}")
    if partitions > layers:
        raise PipeValueError(f"cannot cut {layers} layers into {partitions} partitions; every partition needs a "
                         f"layer, so ask for at most {layers}")


def _check_module(module) -> None:
    if not isinstance(module, nn.Sequential):
        raise PipeTypeError(f"balancing needs the nn.Sequential you will give Pipe, got {type(module).__name__}")


def _default_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _detached(batch, device: torch.device):
    """A fresh leaf copy of `batch` on `device`, so each layer is measured on its own."""
    tensors = tuple(t.detach().to(device).requires_grad_(t.is_floating_point()) for t in tensors_of(to_device(batch, device)))
    return tensors[0] if isinstance(batch, torch.Tensor) else tensors


def _backward(output) -> None:
    outputs = [t for t in tensors_of(output) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def balance_by_time(partitions: int, module: nn.Sequential, sample, *, timeout: float = 1.0,
                    device=None) -> list[int]:
    """A balance for `Pipe` that evens out forward + backward time per partition.

    `sample` is a batch like the ones the pipe will see (the micro-batch size matters). Layers are
    timed one at a time on `device` (default: the current GPU, else the CPU), repeating whole passes
    until `timeout` seconds are spent, after one untimed warm-up pass.
    """
    _check_module(module)
    _check_partitions(partitions, len(module))
    check_batch(sample, "sample")
    device = _default_device(device)
    layers = list(copy.deepcopy(module).to(device))
    times = [0.0] * len(layers)
    began = time.perf_counter()
    passes = 0
    while passes < 2 or time.perf_counter() - began < timeout:
        batch = sample
        for index, layer in enumerate(layers):
            batch = _detached(batch, device)
            _synchronize(device)
            start = time.perf_counter()
            output = layer(batch)
            _backward(output)
            _synchronize(device)
            if passes > 0:  # the first pass warms up allocators and kernels
                times[index] += time.perf_counter() - start
            batch = output
        passes += 1
    return balance_cost(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input, *, chunks: int = 1,
                    param_scale: float = 2.0, device=None) -> list[int]:
    """A balance for `Pipe` that evens out training memory per partition (FairScale's signature).

    Each layer's cost is the bytes autograd saves for its backward on one micro-batch (`input`
    cut into `chunks`) plus `param_scale` times its parameter bytes. Counting saved tensors
    instead of allocator statistics works the same on every device.
    """
    _check_module(module)
    _check_partitions(partitions, len(module))
    check_batch(input, "input")
    chunks = coerce_chunks(chunks)
    device = _default_device(device)
    layers = list(copy.deepcopy(module).to(device))
    batch = split(input, chunks)[0]
    sizes = []
    for layer in layers:
        parameter_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        parameter_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        saved: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameter_storages:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        batch = _detached(batch, device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            batch = layer(batch)
        sizes.append(sum(saved.values()) + param_scale * parameter_bytes)
    return balance_cost(sizes, partitions)
