"""`hvd.SyncBatchNorm`: batch statistics over the whole global batch, not each rank's slice.

torch.nn.SyncBatchNorm runs on GPUs only; this one is written with plain tensor ops and
torch.distributed, so it also runs on CPU. Forward sums (count, sum, sum of squares) across ranks;
backward sums the two terms the input gradient needs. Parameter gradients stay local: the
DistributedOptimizer averages them like every other gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from triax.horovod import basics, handles

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def _sum_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    if basics.size() > 1:
        handles.wait_one(dist.all_reduce(tensor, async_op=True))
    return tensor


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float, momentum: float):
        channels = x.shape[1]
        reduce_dims = [0] + list(range(2, x.dim()))
        x32 = x.float()
        local_count = torch.tensor([x.numel() // channels], dtype=torch.float32, device=x.device)
        stats = torch.cat([local_count, x32.sum(reduce_dims), (x32 * x32).sum(reduce_dims)])
        stats = _sum_across_ranks(stats)
        count = stats[0]
        mean = stats[1:1 + channels] / count
        var = (stats[1 + channels:] / count - mean * mean).clamp_min(0)  # biased, as BN normalizes
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * count / (count - 1).clamp_min(1)
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        normalized = (x32 - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.count, ctx.shape, ctx.reduce_dims = count, shape, reduce_dims
        out = normalized
        if weight is not None:
            out = out * weight.float().view(shape) + bias.float().view(shape)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):
        normalized, invstd, weight = ctx.saved_tensors
        shape, dims = ctx.shape, ctx.reduce_dims
        grad32 = grad_out.float()
        local_sum_grad = grad32.sum(dims)
        local_sum_grad_norm = (grad32 * normalized).sum(dims)
        channels = local_sum_grad.numel()
        sums = _sum_across_ranks(torch.cat([local_sum_grad, local_sum_grad_norm]))
        mean_grad = (sums[:channels] / ctx.count).view(shape)
        mean_grad_norm = (sums[channels:] / ctx.count).view(shape)
        scale = invstd.view(shape)
        if weight is not None:
            scale = scale * weight.float().view(shape)
        grad_x = (grad32 - mean_grad - normalized * mean_grad_norm) * scale
        grad_weight = local_sum_grad_norm.to(weight.dtype) if weight is not None else None
        grad_bias = local_sum_grad.to(weight.dtype) if weight is not None else None
        return grad_x.to(grad_out.dtype), grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.BatchNorm{1,2,3}d that normalizes with global-batch statistics."""

    def _check_input_dim(self, x: torch.Tensor):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {x.dim()}-D")

    def forward(self, x: torch.Tensor):
        self._check_input_dim(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch's BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or not basics.is_initialized() or basics.size() == 1:
            return F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                                self.running_var if not self.training or self.track_running_stats else None,
                                self.weight, self.bias, use_batch_stats, momentum, self.eps)
        running = self.track_running_stats and self.training
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias,
                                            self.running_mean if running else None,
                                            self.running_var if running else None, self.eps, momentum)
