"""The training loss: cross-entropy over the vocabulary in fp32, compiled where the blocks are.

Eagerly, `logits.float()` writes the whole (batch, sequence, vocabulary) tensor a second time in
fp32, and log_softmax a third: for GPT-2 at micro-batch 64 x 1024 tokens that is 13 GB each, about
a quarter of a step on an H200 (docs/performance.md). Compiled, the upcast happens inside the
softmax's reduction and its backward, and neither fp32 tensor is ever written; the arithmetic is
the same fp32 arithmetic, summed in another order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triax.data.targets import IGNORE_INDEX


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean (or summed) cross-entropy of every target that is not IGNORE_INDEX. The loss in fp32
    whatever the compute dtype: a bf16 softmax over the vocabulary loses digits."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


_compiled = None


def compiled_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """token_cross_entropy through torch.compile (compiled once per process, on first use)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(token_cross_entropy)
    return _compiled(logits, targets, reduction)


def loss_function(compile: bool):
    """The loss the trainer calls: compiled when its blocks are (parallel.compile)."""
    return compiled_token_cross_entropy if compile else token_cross_entropy
