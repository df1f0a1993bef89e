"""DPO in the trainer (data.task=preference, dpo.*): the loss and metrics of TRL's DPOTrainer.

Each micro-batch holds `batch_size` pairs as 2 x batch_size rows, the chosen sequences then the
rejected ones (triax.data.preference). A row's answer log-probability is the sum of its targets'
log-probabilities (fp32, as the token loss). The reference is the model the run started
from, as in TRL's DPOTrainer with a PEFT model, without a second model in memory: new adapters
(B = 0) leave the base as it was, so the reference is the model with its adapters off
(triax.models.lora.adapters_disabled, PEFT's disable_adapter); adapters read from
model.lora.init_from are kept as they were read (a copy of this rank's shards of the adapters
alone, TRL's "ref" adapter) and put in place for the reference's forward. Without LoRA the
reference is model.init_from built again in the same layout, frozen (Trainer._frozen_reference). Its forward runs without
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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from triax.runtime.shared_decisions import gather_floats
from triax.data.targets import IGNORE_INDEX
from triax.models.lora import adapters_disabled, is_adapter
from triax.config.dpo import DPOConfig
from triax.tracking.line_fields import LineField

if TYPE_CHECKING:  # names for the types only: the step (triax.train.step) imports this module
    from triax.train.step import TrainingStep

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def answer_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its targets (IGNORE_INDEX: not counted), in fp32."""
    losses = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none")
    if hasattr(losses, "full_tensor"):  # tensor parallel: the vocabulary-parallel loss, replicated
        losses = losses.full_tensor()
    return -losses.view(targets.shape).sum(dim=1)


def pair_losses(config: DPOConfig, logps: torch.Tensor, ref_logps: torch.Tensor,
                lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each pair's loss, each pair's metrics in METRICS order) of rows [chosen..., rejected...]."""
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = config.beta * (chosen_ratio - rejected_ratio)
    if config.loss_type == "sigmoid":
        losses = -F.logsigmoid(delta)
    elif config.loss_type == "hinge":
        losses = torch.relu(1 - delta)
    elif config.loss_type == "ipo":  # TRL's: the log-ratios per answer token, squared distance to 1/(2 beta)
        chosen_length, rejected_length = lengths.chunk(2)
        gap = chosen_ratio / chosen_length.clamp(min=1) - rejected_ratio / rejected_length.clamp(min=1)
        losses = (gap - 1 / (2 * config.beta)) ** 2
    else:  # robust: an unbiased loss under preferences flipped with probability label_smoothing
        smoothing = config.label_smoothing
        losses = (-(1 - smoothing) * F.logsigmoid(delta) + smoothing * F.logsigmoid(-delta)) / (1 - 2 * smoothing)
    with torch.no_grad():
        chosen_reward, rejected_reward = config.beta * chosen_ratio, config.beta * rejected_ratio
        stats = torch.stack([chosen_reward, rejected_reward, (chosen_reward > rejected_reward).float(),
                             chosen_reward - rejected_reward, chosen, rejected], dim=1)
    return losses, stats


class DPOObjective:
    """The trainer's loss for preference data, and the metrics it logs."""

    # On the step line: what TRL's users watch, the share of pairs ranked right and the reward margin.
    line_fields = (LineField("rewards/accuracies", ".3f"), LineField("rewards/margins", ".4f"))

    def __init__(self, config: DPOConfig):
        self.config = config
        self.sums: torch.Tensor | None = None  # the metrics summed over pairs since the last log line
        self.pairs = 0
        self.initial: list[tuple[torch.nn.Parameter, torch.Tensor]] | None = None  # model.lora.init_from's adapters
        self.reference: torch.nn.Module | None = None  # without LoRA: the frozen model.init_from, sharded alike

    @torch.no_grad()
    def keep_initial_adapters(self, model: torch.nn.Module) -> None:
        """Keep the adapters as read from model.lora.init_from (before a resume replaces them)."""
        self.initial = [(parameter, parameter.detach().clone()) for name, parameter in model.named_parameters()
                        if is_adapter(name)]

    @contextlib.contextmanager
    def _reference(self):
        if self.reference is not None:  # a model of its own: nothing to switch
            yield
            return
        if self.initial is None:
            with adapters_disabled():
                yield
            return
        current = [parameter.detach().clone() for parameter, _ in self.initial]
        for parameter, initial in self.initial:
            parameter.copy_(initial)
        try:
            yield
        finally:
            for (parameter, _), value in zip(self.initial, current):
                parameter.copy_(value)

    def _pair_terms(self, steps: TrainingStep, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        with torch.no_grad(), self._reference():
            with steps.precision.autocast(steps.device):
                reference = steps.forward(self.reference if self.reference is not None else model, x)
            ref_logps = answer_logps(reference, y)
            del reference
        with steps.precision.autocast(steps.device):
            logits = steps.forward(model, x)
        lengths = (y != IGNORE_INDEX).sum(dim=1)
        return pair_losses(self.config, answer_logps(logits, y), ref_logps, lengths)

    @torch.no_grad()
    def pair_terms_plain(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
        """Each pair's loss and metrics by a plain model on one process (`triax eval`)."""
        with self._reference():
            ref_logps = answer_logps((self.reference or model)(x), y)
        return pair_losses(self.config, answer_logps(model(x), y), ref_logps, (y != IGNORE_INDEX).sum(dim=1))

    def loss(self, steps: TrainingStep, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of this micro-batch's pairs; their metrics are kept for the log line."""
        losses, stats = self._pair_terms(steps, model, x, y)
        total = stats.sum(dim=0)
        self.sums = total if self.sums is None else self.sums + total
        self.pairs += stats.size(0)
        return losses.mean()

    def take_metrics(self) -> dict:
        """The means since the last call over every rank's pairs (a collective: every rank calls it).
        Tensor-parallel peers hold the same pairs: each is counted alike in sum and count."""
        sums = self.sums.double().tolist() if self.sums is not None else [0.0] * len(METRICS)
        totals = [sum(column) for column in zip(*gather_floats(sums + [float(self.pairs)]))]
        self.sums, self.pairs = None, 0
        return {name: round(value / max(totals[-1], 1.0), 6) for name, value in zip(METRICS, totals)}

    @torch.no_grad()
    def evaluate(self, steps: TrainingStep) -> dict:
        """val_loss (the mean over the validation pairs) and val_ with each metric. Every
        data-parallel rank runs the same number of batches (an empty slot: a pair not counted)."""
        val, batch = steps.data.val, steps.config.trainer.batch_size
        dp, rank = steps.layout.dp, steps.dp_rank
        count = len(val)
        if steps.config.trainer.eval_batches:
            count = min(count, steps.config.trainer.eval_batches * batch * dp)
        steps.raw_model.eval()
        sums, pairs, tokens = torch.zeros(len(METRICS) + 1, dtype=torch.float64), 0, 0
        for step in range(math.ceil(count / (batch * dp))):
            start = step * batch * dp + rank * batch
            indices = list(range(start, min(start + batch, count)))
            x, y = steps.batch(val, torch.tensor(indices or [0]))
            with steps.loss_context():
                losses, stats = self._pair_terms(steps, steps.raw_model, x, y)
            if indices:
                sums += torch.cat([losses[:, None], stats], dim=1).double().sum(dim=0).cpu()
                pairs += len(indices)
                tokens += int((y != IGNORE_INDEX).sum())
        steps.raw_model.train()
        totals = [sum(column) for column in zip(*gather_floats(sums.tolist() + [float(pairs), float(tokens)]))]
        means = [value / max(totals[-2], 1.0) for value in totals[:-2]]
        # Tensor-parallel peers hold the same pairs: the counts are the data-parallel ranks' alone.
        return {"val_loss": means[0], **{f"val_{name}": value for name, value in zip(METRICS, means[1:])},
                "val_pairs": round(totals[-2] * dp / steps.world_size),
                "val_tokens": round(totals[-1] * dp / steps.world_size)}
