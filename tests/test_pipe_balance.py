"""The balancing helpers: an exact minimum of the slowest partition, from measured layer costs."""

import itertools
import random
import time

import pytest
import torch
from torch import nn

from triax.pipe import Pipe, balance_by_size, balance_by_time, balance_cost


def slowest_partition(costs, balance):
    sums, start = [], 0
    for size in balance:
        sums.append(sum(costs[start:start + size]))
        start += size
    return max(sums)


def brute_force_best(costs, partitions):
    """The smallest slowest-partition over every way to cut `costs` into contiguous partitions."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), partitions - 1):
        bounds = (0, *cuts, len(costs))
        balance = [b - a for a, b in zip(bounds, bounds[1:])]
        best = min(best, slowest_partition(costs, balance))
    return best


def test_balance_cost_is_exact_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        layers = rng.randint(1, 9)
        partitions = rng.randint(1, layers)
        costs = [rng.choice([0, 1, 2, 5, rng.random() * 10]) for _ in range(layers)]
        balance = balance_cost(costs, partitions)
        assert len(balance) == partitions and sum(balance) == layers and min(balance) >= 1
        assert slowest_partition(costs, balance) == pytest.approx(brute_force_best(costs, partitions))


def test_balance_cost_examples():
    assert balance_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_cost([1, 1, 1, 1, 4], 2) == [4, 1]
    assert balance_cost([3], 1) == [1]
    assert balance_cost([0, 0, 0], 3) == [1, 1, 1]
    # the slowest partition costs 5 whatever happens; the others are then made as even as possible
    assert balance_cost([5, 1, 1, 1, 1, 1], 3) == [1, 2, 3]
    assert balance_cost([0.1, 0.2, 0.3], 2) == [2, 1]


class Sleep(nn.Module):
    """Costs a known time, forward only; time.sleep stands in for work on any machine."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(2, 2)  # something to take gradients of

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def test_balance_by_time_isolates_the_slow_layers():
    # Two slow layers (20 ms) among fast ones (under a millisecond): three partitions must give each slow
    # layer its own, whatever the machine's speed. The margins are ~20x, not a timing measurement.
    model = nn.Sequential(Sleep(0), Sleep(0), Sleep(0.02), Sleep(0), Sleep(0.02), Sleep(0), Sleep(0))
    balance = balance_by_time(3, model, torch.zeros(4, 2), timeout=0.2, device="cpu")
    starts = [sum(balance[:i]) for i in range(3)]
    owner = [max(i for i, s in enumerate(starts) if s <= layer) for layer in range(7)]
    assert owner[2] != owner[4], balance
    assert model[2].linear.weight.grad is None  # measured on a copy: the module was left alone


def test_balance_by_size_counts_parameters_and_saved_activations():
    torch.manual_seed(0)
    # layer 1 holds 4096x64 weights; layer 3 saves a wide activation for backward; the rest are small.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4096, bias=False), nn.Linear(4096, 64),
                          nn.Linear(64, 64), nn.Linear(64, 64))
    weights = balance_by_size(2, model, torch.zeros(8, 64), param_scale=2.0, device="cpu")
    assert weights == [2, 3]  # the 4096x64 weight alone outweighs everything else
    # Counting activations only, on a large batch: layer 2 saves its 4096-wide input for backward,
    # 64 times what any other layer saves, so it gets a partition of its own.
    big_batch = balance_by_size(3, model, torch.zeros(2048, 64), chunks=2, param_scale=0.0, device="cpu")
    assert big_batch == [2, 1, 2]


def test_a_computed_balance_feeds_pipe():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    balance = balance_by_size(3, model, torch.zeros(4, 8), device="cpu")
    assert balance == [2, 2, 2]
    pipe = Pipe(model, balance=balance, devices=["cpu"] * 3, chunks=2)
    assert pipe(torch.zeros(4, 8)).shape == (4, 8)
