"""The on-the-fly sample order: a permutation, the same on every rank, reshuffled per epoch, and
resumable at any global sample index with any number of processes."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from triax.data import GlobalSampler
from triax.data.permutation import FeistelPermutation


@pytest.mark.parametrize("seed", [0, 1, 1337])
def test_every_small_size_is_a_permutation(seed):
    for n in list(range(1, 70)) + [127, 128, 129, 1000, 4097]:
        order = GlobalSampler(n, seed).epoch_order(0)
        assert sorted(order.tolist()) == list(range(n)), n


def test_ten_to_the_ten_positions_map_into_range_without_collisions():
    n = 10**10
    permutation = FeistelPermutation(n, key=5)
    rng = np.random.default_rng(0)
    positions = np.unique(np.concatenate([rng.integers(0, n, 400_000), np.arange(n - 50_000, n),
                                          np.arange(50_000)]))
    values = permutation(positions)
    assert values.min() >= 0 and values.max() < n
    # A random *function* would collide ~k^2/2n = 8 times on these k = 500k positions; a bijection never does.
    assert len(np.unique(values)) == len(positions)
    # Spread over the whole range, not clustered near the positions.
    assert abs(values.mean() / n - 0.5) < 0.01


def test_order_looks_shuffled_and_each_epoch_and_seed_differ():
    n = 10_000
    sampler = GlobalSampler(n, seed=3)
    first, second = sampler.epoch_order(0), sampler.epoch_order(1)
    assert not torch.equal(first, second)
    assert not torch.equal(first, GlobalSampler(n, seed=4).epoch_order(0))
    assert (first == torch.arange(n)).sum() < 10  # about one fixed point expected
    displacement = (first - torch.arange(n)).abs().float().mean() / n
    assert 0.3 < displacement < 0.37  # a uniform permutation averages n/3
    assert torch.equal(GlobalSampler(n, seed=3, shuffle=False).epoch_order(5), torch.arange(n))


def test_rank_slices_tile_the_global_order_for_any_world_size():
    n, global_batch = 1000, 24
    order = GlobalSampler(n, seed=7).epoch_order(2)
    for world in (1, 2, 3, 4, 8):
        local = global_batch // world
        ranks = [GlobalSampler(n, seed=7) for _ in range(world)]  # one sampler object per "rank"
        for start in range(0, n - global_batch + 1, global_batch):
            pieces = [ranks[rank].rank_slice(2, start, local, rank) for rank in range(world)]
            assert torch.equal(torch.cat(pieces), order[start:start + global_batch])


@pytest.mark.multiprocess
def test_the_order_is_the_same_in_another_process():
    """Nothing depends on the process (no Python hash randomisation, no global RNG)."""
    code = ("import json; from triax.data import GlobalSampler; "
            "print(json.dumps(GlobalSampler(10**9, seed=11).positions(3, 123456, 16).tolist()))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "random", **__import__("os").environ})
    assert json.loads(other.stdout) == GlobalSampler(10**9, seed=11).positions(3, 123456, 16).tolist()


def test_resume_mid_epoch_continues_the_order():
    n, seed, epoch = 5000, 9, 1
    uninterrupted = GlobalSampler(n, seed).epoch_order(epoch)
    # Two processes x 8 took 7 steps, then a fresh sampler on one process x 16 continues.
    before = [GlobalSampler(n, seed).rank_slice(epoch, step * 16, 8, rank) for step in range(7) for rank in (0, 1)]
    resumed = GlobalSampler(n, seed)
    after = [resumed.rank_slice(epoch, 7 * 16 + step * 16, 16, 0) for step in range(5)]
    consumed = torch.cat(before + after)
    assert torch.equal(consumed, uninterrupted[:12 * 16])
    assert len(set(consumed.tolist())) == 12 * 16


def test_huge_dataset_costs_nothing_up_front():
    sampler = GlobalSampler(10**12, seed=1)
    ids = sampler.rank_slice(0, 10**12 - 64, 32, 1)
    assert len(ids) == 32 and int(ids.max()) < 10**12 and len(set(ids.tolist())) == 32
    assert sampler.fits(10**12 - 64, 64) and not sampler.fits(10**12 - 63, 64)
