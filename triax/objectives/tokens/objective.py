"""The token loss as an objective (triax.objectives): the forward and the cross-entropy of the
targets the data gives.

Chat data scores a varying number of tokens per row (the answers), as do packed token documents
that skip their first targets: the step's loss is then the mean over every scored token of the
step, on all ranks and micro-batches together (the step hands the factor that makes this rank's
summed token losses its share of that mean), so every layout and grad_accum computes the same
gradient. Other data's loss is the mean of each micro-batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from triax.objectives import RunParts, StepContext
from triax.objectives.chunked_logits import bounded_cross_entropy, logits_limit_mb


class TokenLoss:
    """The next-token cross-entropy of the data's targets (IGNORE_INDEX: not scored)."""

    line_fields = ()  # the loss alone, which every step line shows
    produces_batches = False
    steps_per_batch = 1  # each step reads its own batch
    text_samples = True

    def __init__(self, token_loss: Callable, mean_per_token: bool, max_logits_mb: float = 0.0):
        self.token_loss = token_loss  # (logits, targets, reduction) -> loss: triax.objectives.tokens.loss
        self.mean_per_token = mean_per_token  # rows score varying numbers of tokens (see the module docstring)
        # parallel.max_logits_mb: larger logits go through the output layer in chunks (0: never)
        self.max_logits_mb = max_logits_mb

    def check(self, layout: Any) -> None:
        """Every layout runs the token loss."""

    def needs_reference(self) -> bool:
        return False

    def loss(self, context: StepContext, model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch`: (inputs, targets, per_token): per_token None, the micro-batch's mean (divided by
        grad_accum); else its summed token losses times per_token, this rank's share of the step's mean."""
        x, y, per_token = batch
        if per_token is None:
            loss = self._cross_entropy(context, model, x, y, "mean")
            return loss / context.grad_accum, loss
        loss = self._cross_entropy(context, model, x, y, "sum") * per_token
        return loss, loss

    def _cross_entropy(self, context: StepContext, model: torch.nn.Module, x: Any, y: torch.Tensor,
                       reduction: str) -> torch.Tensor:
        """From the whole logits where they fit in max_logits_mb (the compiled loss where the blocks
        are), else a chunk of positions at a time through the output layer (triax.objectives.chunked_logits)."""
        return bounded_cross_entropy(context.forward, model, x, y, reduction, self.token_loss, self.max_logits_mb,
                                     context.autocast)

    def take_figures(self) -> dict:
        return {}

    def evaluate(self, context: StepContext) -> None:
        """None: the token loss is scored over the validation windows by the step's own evaluation
        (triax.train.evaluation), which runs them through a pipeline schedule as training does."""
        return None


def build(parts: RunParts) -> TokenLoss:
    """Chat's answers, and packed documents that skip their first targets, score a varying number
    of tokens per row: their loss is a mean per token of the step."""
    data = parts.config.data
    varying = data.task == "chat" or (data.task == "tokens" and data.packing and not data.score_document_starts)
    return TokenLoss(parts.token_loss, varying, logits_limit_mb(parts.config.parallel.max_logits_mb, parts.device))
