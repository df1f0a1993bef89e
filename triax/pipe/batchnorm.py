"""BatchNorm whose running statistics follow the mini-batch, not each micro-batch.

Inside a pipe every BatchNorm sees micro-batches. It still normalises each one with that
micro-batch's own statistics (waiting for the whole mini-batch would stop the pipeline), but a
plain BatchNorm would also update its running mean and variance once per micro-batch, so after
training they describe small batches and the momentum is applied `chunks` times per step.
`DeferredBatchNorm` instead gathers the statistics of all micro-batches of a step and updates the
running estimates once, with the mean and unbiased variance of the whole mini-batch: the same
numbers a plain BatchNorm fed the unsplit batch would store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from triax.pipe.checkpoint import is_recomputing


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm (any dimensionality) that updates running statistics once per mini-batch.

    `Pipe` calls `commit()` after each training forward pass; nothing else needs to.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, chunks: int = 1, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True,
                         device=device, dtype=dtype)
        self.chunks = chunks
        self._clear()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D")

    def _clear(self) -> None:
        # Running count, mean and sum of squared deviations per channel (Chan et al.'s pairwise
        # update: stable where sum(x^2) - n*mean^2 would cancel catastrophically).
        self._count = 0
        self._mean = None
        self._squares = None

    def _accumulate(self, input: torch.Tensor) -> None:
        dims = [0] + list(range(2, input.dim()))
        values = input.detach().float()
        count = values.numel() // values.size(1)
        variance, mean = torch.var_mean(values, dim=dims, correction=0)
        squares = variance * count
        if self._count == 0:
            self._count, self._mean, self._squares = count, mean, squares
            return
        total = self._count + count
        delta = mean - self._mean
        self._mean = self._mean + delta * (count / total)
        self._squares = self._squares + squares + delta.square() * (self._count * count / total)
        self._count = total

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():  # a recomputed micro-batch was already counted in forward
            self._accumulate(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def discard(self) -> None:
        """Forget the statistics gathered since the last commit (the forward pass failed)."""
        self._clear()

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the statistics gathered since the last commit into the running estimates."""
        if self._count == 0:
            return
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = self._squares / max(self._count - 1, 1)
        self.running_mean.mul_(1 - factor).add_(self._mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        self._clear()

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """Replace every BatchNorm that tracks running statistics inside `module` (in place).

        Returns the module itself, or a new `DeferredBatchNorm` when `module` is a BatchNorm.
        Weights, biases and running statistics are carried over.
        """
        if isinstance(module, _BatchNorm) and module.track_running_stats and not isinstance(module, cls):
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine, chunks,
                           device=module.running_mean.device, dtype=module.running_mean.dtype)
            with torch.no_grad():
                if module.affine:
                    deferred.weight = module.weight
                    deferred.bias = module.bias
                deferred.running_mean.copy_(module.running_mean)
                deferred.running_var.copy_(module.running_var)
                deferred.num_batches_tracked.copy_(module.num_batches_tracked)
            deferred.train(module.training)
            return deferred
        for name, child in module.named_children():
            converted = cls.convert_deferred_batch_norm(child, chunks)
            if converted is not child:
                setattr(module, name, converted)
        return module
