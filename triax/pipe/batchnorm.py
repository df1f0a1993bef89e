"""BatchNorm whose running statistics follow the mini-batch, not each micro-batch.

Inside a pipe every BatchNorm sees micro-batches. It still normalises each one with that
micro-batch's own statistics (waiting for the whole mini-batch would stop the pipeline), but a
plain BatchNorm would also update its running mean and variance once per micro-batch, so after
training they describe small batches and the momentum is applied `chunks` times per step.
`DeferredBatchNorm` instead gathers the statistics of `chunks` micro-batches and then updates the
running estimates once, with the mean and unbiased variance of all of them: the same numbers a
plain BatchNorm fed the unsplit batch would store. It does so on its own, as FairScale's does,
so it also works without a `Pipe` (feed it the micro-batches one by one); a `Pipe` additionally
updates it at the end of each mini-batch, which matters when a small batch gives fewer than
`chunks` micro-batches.

The gathered statistics are FairScale's buffers `sum` and `sum_squares` (per channel: the sum of
the values and of their squares since the last update, zero after it), so state dicts read and
write the same keys. They are kept in float64 (also when the module is cast), and each micro-batch adds its exact contribution
from its own mean and variance: the variance is then sum_squares - sum^2/n without the
catastrophic cancellation float32 would give when the mean is large against the spread.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from triax.pipe.recompute import is_recomputing

_ACCUMULATOR_DTYPE = torch.float64  # see the module docstring


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm (any dimensionality) that updates running statistics once per `chunks` micro-batches."""

    sum: torch.Tensor
    sum_squares: torch.Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 chunks: int = 1, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True,
                         device=device, dtype=dtype)
        accumulator = torch.zeros(num_features, device=self.running_mean.device, dtype=_ACCUMULATOR_DTYPE)
        self.register_buffer("sum", accumulator)
        self.register_buffer("sum_squares", accumulator.clone())
        self.counter = 0  # values per channel gathered since the last update
        self.tracked = 0  # micro-batches gathered since the last update
        self.chunks = chunks

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any):
        # A cast of the module (.half(), .to(torch.bfloat16)) is for its parameters and running
        # statistics; sums over a whole mini-batch would overflow or cancel in half precision.
        super()._apply(fn, *args, **kwargs)
        for name in ("sum", "sum_squares"):
            self._buffers[name] = self._buffers[name].to(_ACCUMULATOR_DTYPE)
        return self

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D")

    @torch.no_grad()
    def _track(self, input: torch.Tensor) -> None:
        dims = [0] + list(range(2, input.dim()))
        count = input.numel() // input.size(1)
        variance, mean = torch.var_mean(input.detach().float(), dim=dims, correction=0)
        mean = mean.to(self.sum.dtype)
        self.sum += mean * count
        self.sum_squares += (variance.to(self.sum.dtype) + mean.square()) * count
        self.counter += count
        self.tracked += 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():  # a recomputed micro-batch was already counted in forward
            self._track(input)
            if self.tracked >= self.chunks:
                self.commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def discard(self) -> None:
        """Forget the statistics gathered since the last update (the forward pass failed)."""
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counter = self.tracked = 0

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the statistics gathered since the last update into the running estimates."""
        if self.counter == 0:
            return
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        mean = self.sum / self.counter
        squared_deviations = (self.sum_squares - self.sum * mean).clamp_(min=0)
        unbiased = squared_deviations / max(self.counter - 1, 1)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        self.discard()

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """Replace every BatchNorm that tracks running statistics inside `module`, as FairScale does.

        A BatchNorm (a DeferredBatchNorm with another `chunks` too) becomes a new DeferredBatchNorm
        sharing its weight, bias and running statistics; a DeferredBatchNorm with these `chunks` is
        returned as it is; any other module has its children converted in place and is returned.
        """
        if isinstance(module, cls) and module.chunks == chunks:
            return module
        converted = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            converted = cls(module.num_features, module.eps, module.momentum, module.affine, chunks,
                            device=module.running_mean.device, dtype=module.running_mean.dtype)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return converted
