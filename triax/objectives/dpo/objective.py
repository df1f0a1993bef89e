"""DPO as an objective (triax.objectives): the loss and metrics of TRL's DPOTrainer on preference
pairs (data.task=preference, dpo.*).

Each micro-batch holds `batch_size` pairs as 2 x batch_size rows, the chosen sequences then the
rejected ones (triax.data.preference). A row's answer log-probability is the sum of its targets'
log-probabilities (fp32, as the token loss). The reference is the model the run started from
(triax.objectives.reference: a frozen copy without LoRA, else the policy with its adapters off or
as read from model.lora.init_from, as TRL's DPOTrainer with a PEFT model). Its forward runs without
gradients, the policy's with them, in the same layout and precision.

The loss of a micro-batch is the mean of its pairs' losses (TRL's), so a step of grad_accum
micro-batches on dp ranks is the mean over its pairs, whatever the layout. The metrics are TRL's:
rewards/chosen and rewards/rejected (beta x the log-ratio of policy to reference), rewards/
accuracies (the share of pairs whose chosen reward is the higher), rewards/margins, logps/chosen
and logps/rejected, each a mean over the pairs since the last log line.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from triax.data.targets import IGNORE_INDEX
from triax.objectives import StepContext
from triax.objectives.chunked_logits import chunk_positions, output_layer, target_losses
from triax.objectives.dpo.config import DPOConfig, check_layout
from triax.objectives.dpo.loss import METRICS, answer_logps, pair_losses
from triax.objectives.reference import Reference
from triax.runtime.shared_decisions import gather_floats
from triax.tracking.line_fields import LineField


class DPOObjective:
    """The trainer's loss for preference data, and the metrics it logs."""

    # On the step line: what TRL's users watch, the share of pairs ranked right and the reward margin.
    line_fields = (LineField("rewards/accuracies", ".3f"), LineField("rewards/margins", ".4f"))
    produces_batches = False  # pairs are read from the data
    steps_per_batch = 1  # each step reads its own batch
    mean_per_token = False  # a mean over pairs
    text_samples = True

    def __init__(self, config: DPOConfig, max_logits_mb: float = 0.0):
        self.config = config
        # parallel.max_logits_mb: larger logits go through the output layer in chunks (0: never)
        self.max_logits_mb = max_logits_mb
        self.sums: torch.Tensor | None = None  # the metrics summed over pairs since the last log line
        self.pairs = 0
        self.reference = Reference()  # until the run gives its own (use_reference): the policy, adapters off
        self.model: torch.nn.Module | None = None  # the plain policy evaluation scores
        self.validation: Any = None  # the validation pairs
        self.eval_limit = 0  # at most this many of them per evaluation (0: all)
        self.batch_size = 1  # pairs per data-parallel rank and batch

    # ---- the interface ------------------------------------------------------------------------------

    def check(self, layout: Any) -> None:
        check_layout(layout)

    def needs_reference(self) -> bool:
        return True

    def use_reference(self, reference: Reference) -> None:
        self.reference = reference

    def loss(self, context: StepContext, model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean loss of this micro-batch's pairs (divided by grad_accum, and as logged); their metrics
        are kept for the log line. `batch`: (inputs, targets, per-token scale: unused)."""
        losses, stats = self._pair_terms(context, model, batch[0], batch[1])
        total = stats.sum(dim=0)
        self.sums = total if self.sums is None else self.sums + total
        self.pairs += stats.size(0)
        mean = losses.mean()
        return mean / context.grad_accum, mean

    def take_figures(self) -> dict:
        """The means since the last call over every rank's pairs (a collective: every rank calls it).
        Tensor-parallel peers hold the same pairs: each is counted alike in sum and count."""
        sums = self.sums.double().tolist() if self.sums is not None else [0.0] * len(METRICS)
        totals = [sum(column) for column in zip(*gather_floats(sums + [float(self.pairs)]))]
        self.sums, self.pairs = None, 0
        return {name: round(value / max(totals[-1], 1.0), 6) for name, value in zip(METRICS, totals)}

    @torch.no_grad()
    def evaluate(self, context: StepContext) -> dict:
        """val_loss (the mean over the validation pairs) and val_ with each metric. Every
        data-parallel rank runs the same number of batches (an empty slot: a pair not counted)."""
        val, batch = self.validation, self.batch_size
        dp, rank = context.data_parallel_size, context.data_parallel_rank
        count = min(len(val), self.eval_limit) if self.eval_limit else len(val)
        self.model.eval()
        sums, pairs, tokens = torch.zeros(len(METRICS) + 1, dtype=torch.float64), 0, 0
        for step in range(math.ceil(count / (batch * dp))):
            start = step * batch * dp + rank * batch
            indices = list(range(start, min(start + batch, count)))
            x, y = context.read(val, torch.tensor(indices or [0]))
            with context.loss_context():
                losses, stats = self._pair_terms(context, self.model, x, y)
            if indices:
                sums += torch.cat([losses[:, None], stats], dim=1).double().sum(dim=0).cpu()
                pairs += len(indices)
                tokens += int((y != IGNORE_INDEX).sum())
        self.model.train()
        totals = [sum(column) for column in zip(*gather_floats(sums.tolist() + [float(pairs), float(tokens)]))]
        means = [value / max(totals[-2], 1.0) for value in totals[:-2]]
        # Tensor-parallel peers hold the same pairs: the counts are the data-parallel ranks' alone.
        return {"val_loss": means[0], **{f"val_{name}": value for name, value in zip(METRICS, means[1:])},
                "val_pairs": round(totals[-2] * dp / context.world_size),
                "val_tokens": round(totals[-1] * dp / context.world_size)}

    # ---- the pairs' terms -----------------------------------------------------------------------------

    def _pair_terms(self, context: StepContext, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        chunk = chunk_positions(model, y, self.max_logits_mb)  # the same for both models: one vocabulary
        with torch.no_grad(), self.reference.switched():
            ref_logps = self._answer_logps(context, self.reference.module(model), x, y, chunk)
        lengths = (y != IGNORE_INDEX).sum(dim=1)
        return pair_losses(self.config, self._answer_logps(context, model, x, y, chunk), ref_logps, lengths)

    @staticmethod
    def _answer_logps(context: StepContext, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      chunk: int) -> torch.Tensor:
        """Each row's answer log-probability: from the whole logits where they fit in max_logits_mb,
        else a chunk of positions at a time through the output layer (the same fp32 token losses,
        triax.objectives.chunked_logits), so at most one chunk's logits exist."""
        with context.autocast():
            if chunk < y.numel():
                hidden = context.forward(model, x, logits=False)
                return -target_losses(output_layer(model), hidden, y, chunk).sum(dim=1)
            logits = context.forward(model, x)
        return answer_logps(logits, y)

    @torch.no_grad()
    def pair_terms_plain(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        """Each pair's loss and metrics by a plain model on one process (`triax eval`), the logits in
        chunks where they would pass max_logits_mb, as the step takes them."""
        plain = StepContext(x.device, contextlib.nullcontext, _plain_forward, grad_accum=1, data_parallel_size=1,
                            data_parallel_rank=0, seed=0)
        chunk = chunk_positions(model, y, self.max_logits_mb)
        with self.reference.switched():
            ref_logps = self._answer_logps(plain, self.reference.module(model), x, y, chunk)
        return pair_losses(self.config, self._answer_logps(plain, model, x, y, chunk), ref_logps,
                           (y != IGNORE_INDEX).sum(dim=1))


def _plain_forward(model: torch.nn.Module, ids: torch.Tensor, logits: bool = True) -> torch.Tensor:
    return model(ids, logits=logits)
