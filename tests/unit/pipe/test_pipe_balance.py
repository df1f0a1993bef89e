"""The balancing helpers: FairScale's block partition by default, an exact minimum of the slowest
partition with exact=True, from measured layer costs."""

import itertools
import random
import time

import pytest
import torch
from torch import nn

from triax.pipe import Pipe, balance_by_size, balance_by_time, balance_cost
from triax.pipe.balance import blockpartition, profile


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
    balance = balance_by_time(3, model, torch.zeros(4, 2), timeout=0.2, device="cpu", exact=True)
    starts = [sum(balance[:i]) for i in range(3)]
    owner = [max(i for i, s in enumerate(starts) if s <= layer) for layer in range(7)]
    assert owner[2] != owner[4], balance
    assert model[2].linear.weight.grad is None  # measured on a copy: the module was left alone


def test_balance_by_size_counts_parameters_and_saved_activations():
    torch.manual_seed(0)
    # layer 1 holds 4096x64 weights; layer 3 saves a wide activation for backward; the rest are small.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4096, bias=False), nn.Linear(4096, 64),
                          nn.Linear(64, 64), nn.Linear(64, 64))
    weights = balance_by_size(2, model, torch.zeros(8, 64), param_scale=2.0, device="cpu", exact=True)
    assert weights == [2, 3]  # the 4096x64 weight alone outweighs everything else
    # Counting activations only, on a large batch: layer 2 saves its 4096-wide input for backward,
    # 64 times what any other layer saves, so it gets a partition of its own.
    big_batch = balance_by_size(3, model, torch.zeros(2048, 64), chunks=2, param_scale=0.0, device="cpu",
                                exact=True)
    assert big_batch == [2, 1, 2]


def test_a_computed_balance_feeds_pipe():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    balance = balance_by_size(3, model, torch.zeros(4, 8), device="cpu")
    assert balance == [2, 2, 2]
    pipe = Pipe(model, balance=balance, devices=["cpu"] * 3, chunks=2)
    assert pipe(torch.zeros(4, 8)).shape == (4, 8)


def test_block_partition_is_within_one_dearest_layer():
    # The guarantee of the block-partition procedure: with costs rescaled onto [0, 1], the heaviest
    # block outweighs the lightest by at most 1; the blocks are the sequence, in order, none empty.
    rng = random.Random(1)
    for _ in range(300):
        length = rng.randint(1, 12)
        partitions = rng.randint(1, length)
        costs = [rng.choice([0, 1, 3, rng.random() * 100]) for _ in range(length)]
        blocks = blockpartition.solve(costs, partitions)
        assert len(blocks) == partitions and all(blocks)
        assert [cost for block in blocks for cost in block] == costs
        low, spread = min(costs), max(costs) - min(costs)
        weights = [sum((c - low) / spread for c in block) if spread else 0.0 for block in blocks]
        assert max(weights) <= min(weights) + 1 + 1e-12, (costs, blocks)


def test_block_partition_examples():
    assert blockpartition.solve([10, 20, 30, 40, 50, 60], partitions=2) == [[10, 20, 30, 40], [50, 60]]
    assert blockpartition.solve([6, 5, 4, 3, 2, 1], partitions=2) == [[6, 5], [4, 3, 2, 1]]  # the mirror image
    assert blockpartition.solve([7, 7, 7], partitions=3) == [[7], [7], [7]]
    # Even to within one dearest layer is all it promises: [1, 1] against [1, 1, 4] stops there,
    # where the exact minimum of the slowest partition puts the dear layer alone.
    assert blockpartition.solve([1, 1, 1, 1, 4], partitions=2) == [[1, 1], [1, 1, 4]]
    assert balance_cost([1, 1, 1, 1, 4], 2) == [4, 1]
    # Equal costs are where taking the first of several equally light blocks (FairScale's tie rule)
    # goes wrong: here it would leave the middle block empty, and on the second it never stops.
    # The nearest-to-the-heaviest rule of the paper gives every block a layer, and stops.
    assert blockpartition.solve([0, 0, 1, 1], partitions=3) == [[0], [0, 1], [1]]
    assert blockpartition.solve([0, 0, 0, 0, 1, 1], partitions=5) == [[0], [0], [0], [0, 1], [1]]
    for partitions, length in [(0, 1), (-1, 1), (1, 0), (2, 1)]:
        with pytest.raises(ValueError):
            blockpartition.solve([5] * length, partitions=partitions)


@pytest.mark.parametrize("helper, profiler", [(balance_by_time, "profile_times"), (balance_by_size, "profile_sizes")])
def test_helpers_cut_like_fairscale_unless_exact(monkeypatch, helper, profiler):
    import triax.pipe.balance as balance_package
    monkeypatch.setattr(balance_package, profiler, lambda *args: [1.0, 1.0, 1.0, 1.0, 4.0])
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    assert helper(2, model, torch.zeros(4, 2), device="cpu") == [2, 3]
    assert helper(2, model, torch.zeros(4, 2), device="cpu", exact=True) == [4, 1]


class RequireTraining(nn.Module):
    def forward(self, x):
        assert self.training, "profiled in eval mode"
        return x * 2


def test_layers_are_profiled_as_training_copies():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), RequireTraining()).eval()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    copies = list(profile.layerwise_sandbox(model, torch.device("cpu")))
    assert all(layer.training for layer in copies)
    assert all(copy is not layer for copy, layer in zip(copies, model))
    balance_by_time(1, model, torch.rand(4, 3), timeout=0.0, device="cpu")
    assert not any(layer.training for layer in model)  # the caller's mode is left alone
    for name, value in model.state_dict().items():  # and so are BatchNorm's running statistics
        assert torch.equal(value, state[name]), name


def test_a_model_with_gradients_is_refused_as_in_fairscale():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model(torch.rand(2, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"some parameter already has gradient \(0.weight\).*zero_grad"):
        balance_by_time(1, model, torch.rand(2, 3), device="cpu")
    model.zero_grad(set_to_none=True)
    assert balance_by_time(2, model, torch.rand(2, 3), timeout=0.0, device="cpu") == [1, 1]
