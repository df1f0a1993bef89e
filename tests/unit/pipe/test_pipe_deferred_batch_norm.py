"""DeferredBatchNorm on its own (FairScale's semantics): fed `chunks` micro-batches one by one, its
running statistics equal those of nn.BatchNorm fed the whole batch at once."""

import copy

import pytest
import torch
from torch import nn

from triax.pipe import DeferredBatchNorm

CHUNKS = 4


def batches(steps: int, mean: float, spread: float):
    torch.manual_seed(0)
    return [torch.randn(12, 3, 4, 4) * spread + mean for _ in range(steps)]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_alone_it_updates_after_chunks_micro_batches_like_batch_norm_on_the_whole_batch(momentum):
    plain = nn.BatchNorm2d(3, momentum=momentum)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=CHUNKS)
    for batch in batches(3, mean=1.0, spread=2.0):
        before = deferred.running_mean.clone(), deferred.running_var.clone()
        micro_batches = batch.chunk(CHUNKS)
        for micro_batch in micro_batches[:-1]:
            deferred(micro_batch)
        # nothing committed before the last micro-batch of the mini-batch
        torch.testing.assert_close((deferred.running_mean, deferred.running_var), before, rtol=0, atol=0)
        deferred(micro_batches[-1])
        plain(batch)
        # float32 statistics of 192 values per channel, rounded in another order: a few ulps
        torch.testing.assert_close(deferred.running_mean, plain.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(deferred.running_var, plain.running_var, rtol=1e-5, atol=1e-6)
        assert int(deferred.num_batches_tracked) == int(plain.num_batches_tracked)
    deferred.eval(), plain.eval()
    probe = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(deferred(probe), plain(probe), rtol=1e-5, atol=1e-5)


def test_the_variance_survives_a_large_mean():
    # Mean 10, spread 0.01: in float32, sum(x^2)/n - mean^2 would lose the variance (1e-4) in the
    # rounding of 100.0001 (one ulp is 7.6e-6, and thousands of values are summed). Each value's
    # float32 rounding moves a micro-batch mean by at most 10 * 2^-24 = 6e-7, which changes the
    # variance by about 2 * 0.01 * 6e-7 = 1.2e-8 relative to 1e-4: 1e-4 relative, so 1e-3 is safe.
    plain = nn.BatchNorm2d(3, momentum=None)  # cumulative average: the first update is the batch's variance
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=CHUNKS)
    batch = batches(1, mean=10.0, spread=0.01)[0]
    plain(batch)
    for micro_batch in batch.chunk(CHUNKS):
        deferred(micro_batch)
    torch.testing.assert_close(deferred.running_var, plain.running_var, rtol=1e-3, atol=0)


def test_converting_follows_fairscale():
    plain = nn.BatchNorm2d(3)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(plain, chunks=CHUNKS)
    assert type(deferred) is DeferredBatchNorm and deferred.chunks == CHUNKS
    # the new layer shares the old one's parameters and statistics
    assert deferred.weight is plain.weight and deferred.running_mean is plain.running_mean
    assert DeferredBatchNorm.convert_deferred_batch_norm(deferred, chunks=CHUNKS) is deferred
    again = DeferredBatchNorm.convert_deferred_batch_norm(deferred, chunks=CHUNKS + 1)
    assert again is not deferred and again.chunks == CHUNKS + 1 and again.weight is plain.weight
    untracked = nn.BatchNorm2d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert_deferred_batch_norm(untracked, chunks=CHUNKS) is untracked
    container = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    assert DeferredBatchNorm.convert_deferred_batch_norm(container, chunks=CHUNKS) is container
    assert type(container[1]) is DeferredBatchNorm


def test_state_dict_has_fairscales_keys_and_casts_keep_the_sums_wide():
    deferred = DeferredBatchNorm(3, chunks=CHUNKS)
    assert set(deferred.state_dict()) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked",
                                          "sum", "sum_squares"}
    inputs = torch.rand(4, 3, 2, 2, requires_grad=True)
    deferred(inputs)
    assert not deferred.sum.requires_grad and deferred.sum.grad_fn is None
    deferred.to(torch.bfloat16)
    assert deferred.running_mean.dtype == torch.bfloat16 and deferred.sum.dtype == torch.float64
    deferred(inputs.detach().to(torch.bfloat16))  # the sums keep growing in float64
    assert deferred.tracked == 2
