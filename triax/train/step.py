"""One optimizer step of `triax train`, and where training stands.

Each step takes the next global batch in the data order (see triax.data.sampler), runs
`grad_accum` micro-batches with gradient sync only on the last (or one pipeline schedule over
them), then clips, steps and schedules. What the loss is belongs to the run's objective
(triax.objectives: the token loss, or another data.task's), handed the step's narrow context; the
terms a model adds to any objective (a mixture of experts' balance losses) are added to it. The
same batches and forward serve evaluation (triax.train.evaluation).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from triax.data import GlobalSampler
from triax.data.targets import IGNORE_INDEX
from triax.data.windows import mask_unscored
from triax.parallel.context_parallel import local_chunks
from triax.parallel.ddp import unwrap
from triax.parallel.grad_clip import clip_grad_norm
from triax.train.finite_watch import FiniteWatch
from triax.parallel.mesh import Layout
from triax.parallel.no_sync import no_sync
from triax.parallel.parallelize import ParallelModel
from triax.runtime.precision import Precision
from triax.runtime.shared_decisions import gather_floats
from triax.runtime.watchdog import Watchdog
from triax.train.data import TrainData
from triax.train.sample_log import SampleLog
from triax.config.schema import TrainConfig
from triax.objectives import Objective, StepContext
from triax.objectives.registry import objective_for


@dataclass
class Position:
    """Where training is: optimizer steps taken, the epoch, and the global sample index within the
    epoch where the next step starts."""

    step: int = 0
    epoch: int = 0
    sample_index: int = 0


@dataclass
class Optimization:
    """What a step updates besides the weights: AdamW, its schedule, the loss scaler, and the data
    order the step draws from."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: GlobalSampler


@dataclass
class RankPlace:
    """This rank's place in the layout, as the step needs it."""

    layout: Layout
    device: torch.device
    world_size: int
    dp_rank: int
    cp_rank: int
    pp_group: object | None  # the pipeline's process group (pp > 1)


class TrainingStep:
    """One rank's step: batches to the device, the forward and the objective's loss, the backward
    with gradient sync on the last micro-batch, and the optimizer step. Keeps this rank's seconds in
    the log interval (`timing`) and, for rows whose answers alone are scored, the tokens it read
    (`counted`)."""

    def __init__(self, config: TrainConfig, place: RankPlace, precision: Precision, data: TrainData,
                 parallel_model: ParallelModel, optimization: Optimization, token_loss: Callable,
                 objective: Objective, terms: Sequence, sample_log: SampleLog | None, watchdog: Watchdog | None):
        self.config, self.place, self.precision, self.data = config, place, precision, data
        self.layout, self.device, self.world_size = place.layout, place.device, place.world_size
        self.dp_rank = place.dp_rank
        self.parallel_model, self.model = parallel_model, parallel_model.model
        # The plain GPT to call for evaluation and sampling (sharded in place by TP/FSDP); a
        # pipeline rank holds only stages of it and evaluates through the schedule instead.
        self.raw_model = None if parallel_model.pipelined else unwrap(parallel_model.model)
        # token_loss: what a pipeline's last stage and the validation windows score with.
        self.optimization, self.token_loss = optimization, token_loss
        self.sample_log, self.watchdog = sample_log, watchdog
        # What the loss is (triax.objectives), and the terms a model adds to any (a mixture of experts').
        self.objective, self.terms = objective, list(terms)
        self.counts_answers = objective_for(config.data.task).scores_answers
        self.steps_per_batch = objective.steps_per_batch  # a produced batch may serve several steps
        self.context = StepContext(place.device, lambda: precision.autocast(place.device), self.forward,
                                   config.trainer.grad_accum, place.layout.dp, place.dp_rank, config.trainer.seed,
                                   place.world_size, self.loss_context, self.batch)
        self.position = Position()
        self.samples_per_step = config.trainer.batch_size * self.layout.dp * config.trainer.grad_accum
        self.first_step = True  # compiles and sets up lazily: the watchdog gives it the slow allowance
        self.timing = {"step": 0.0, "data": 0.0, "forward": 0.0}  # this rank's seconds in the log interval
        # Rows whose answers alone are scored vary: this rank's training tokens of the log interval,
        # counted as read (the positions computed, padding included; the targets the loss sees).
        self.counted = [0, 0]
        self.pipeline_reduction = "mean"  # what pipeline_loss returns: "sum" while evaluating
        self.finite = FiniteWatch(self.device, optimization.scaler.is_enabled())  # a NaN stops the run

    # ---- batches --------------------------------------------------------------------------------

    def phase(self, name: str, step: int, micro: int = 0) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(name, step, micro, slow=self.first_step)

    def timed_batch(self, step: int, micro: int, indices: torch.Tensor, scored: list | None = None):
        self.phase("data", step, micro)
        started = time.perf_counter()
        batch = self.batch(self.data.train, indices, scored)
        self.timing["data"] += time.perf_counter() - started
        return batch

    def counts_tokens(self) -> bool:
        return self.counts_answers

    def batch(self, dataset: object, indices: torch.Tensor, scored: list | None = None,
              first_scored: torch.Tensor | None = None):
        """(inputs, targets) on the device; packed chat rows' inputs are (ids, example numbers).
        `scored` (a list) gets the number of tokens the loss scores, counted on the host before the
        copy: counting on a GPU would wait there for the step in flight. `first_scored`: evaluation
        windows' first scored position (triax.data.windows). Under context parallelism the ids and
        targets are this rank's part of each sequence (the example numbers stay whole: attention
        looks them up for the keys of the whole sequence)."""
        x, y = dataset.batch(indices)
        if first_scored is not None:
            y = mask_unscored(y, first_scored)
        x, y = (local_chunks(t, self.place.cp_rank, self.layout.cp) for t in (x, y))
        if scored is not None:
            scored.append(int((y != IGNORE_INDEX).sum()))
        if dataset is self.data.train and self.counts_tokens():
            self.counted[0] += x.numel()
            self.counted[1] += scored[-1] if scored else int((y != IGNORE_INDEX).sum())
        if getattr(dataset, "packing", False):
            return (self.to_device(x), self.to_device(dataset.document_ids(indices))), self.to_device(y)
        return self.to_device(x), self.to_device(y)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor.to(self.device)
        # From page-locked memory the copy is queued behind the step in flight instead of waiting for
        # it, so the host goes on to launch the next step's kernels (nanoGPT's get_batch does the same).
        return tensor.pin_memory().to(self.device, non_blocking=True)

    # ---- forward and loss -----------------------------------------------------------------------

    @staticmethod
    def forward(model: torch.nn.Module, x: torch.Tensor | tuple, logits: bool = True) -> torch.Tensor:
        """The logits of `x`, or (`logits=False`) the final hidden states, for a loss that takes the
        output layer a chunk of positions at a time (triax.objectives.chunked_logits)."""
        extra = {} if logits else {"logits": False}  # the plain call where logits are asked: any model takes it
        if isinstance(x, tuple):  # packed rows: attention and positions confined to each example
            ids, documents = x
            return model(ids, documents=documents, **extra)
        return model(x, **extra)

    def per_token_scale(self, scored: list[int] | None) -> float | None:
        """An objective whose rows score a varying number of tokens (chat's answers) has each step's
        loss the mean over every scored token of the step, on all ranks and micro-batches together,
        not a mean of per-batch means, so every layout and grad_accum computes the same gradient.
        `scored`: the tokens each of this rank's micro-batches scores (counted on the host).
        Returns the factor that turns this rank's summed token losses into its share of that mean
        (data parallelism averages the ranks' gradients); None for data that scores every token,
        and under a pipeline schedule (its loss is a mean per micro-batch, computed on the last stage)."""
        if not self.scores_per_token():
            return None
        # Tensor and pipeline peers hold the same tokens: the world's sum counts each world/reducing times.
        reducing = self.layout.reducing
        total = sum(values[0] for values in gather_floats([float(sum(scored))])) * reducing / self.world_size
        return reducing / max(total, 1.0)

    def scores_per_token(self) -> bool:
        """Context-parallel ranks hold different tokens of a row: their loss is always the mean over
        every token of the step, so that it equals one process's mean however the targets fall."""
        return (self.objective.mean_per_token or self.layout.cp > 1) and not self.parallel_model.pipelined

    def pipeline_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.pipeline_reduction == "sum":  # evaluation: no backward, no scaling
            return self.token_loss(logits, y, reduction="sum")
        # The schedule runs backward on what this returns: scale it here for fp16.
        return self.optimization.scaler.scale(self.token_loss(logits, y))

    def loss_context(self):
        """Tensor parallelism leaves the logits vocabulary-sharded: the loss and its backward then
        run under loss_parallel, which computes the softmax without gathering the vocabulary."""
        if self.parallel_model.loss_parallel:
            return loss_parallel()
        return contextlib.nullcontext()

    def pipeline_forward(self, x: torch.Tensor, y: torch.Tensor, train: bool,
                         reduction: str = "mean") -> torch.Tensor:
        """Run the pipeline schedule on one batch (forward and, if `train`, backward); returns the
        mean micro-batch loss (reduction="sum", evaluation only: the summed loss of every target),
        on every rank (the last stage broadcasts it down the pipeline)."""
        pm = self.parallel_model
        losses: list[torch.Tensor] = []
        inputs = (x,) if pm.is_first_stage else ()
        target = y if pm.is_last_stage else None
        self.pipeline_reduction = reduction
        try:
            with self.precision.autocast(self.device):
                if train:
                    pm.schedule.step(*inputs, target=target, losses=losses)
                else:
                    pm.schedule.eval(*inputs, target=target, losses=losses)
        finally:
            self.pipeline_reduction = "mean"
        scaler = self.optimization.scaler
        if pm.is_last_stage and reduction == "sum":
            loss = torch.stack([item.detach().double() for item in losses]).sum()
        elif pm.is_last_stage:
            loss = torch.stack([item.detach().float() for item in losses]).mean()
            if scaler.is_enabled():
                loss = loss / scaler.get_scale()
        else:
            loss = torch.zeros((), device=self.device, dtype=torch.float64 if reduction == "sum" else torch.float32)
        last_rank = dist.get_global_rank(self.place.pp_group, self.layout.pp - 1)
        dist.broadcast(loss, src=last_rank, group=self.place.pp_group)
        return loss

    # ---- the step -------------------------------------------------------------------------------

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns this rank's mean micro-batch loss and the gradient norm as
        tensors on the device, not yet read: reading them waits for the GPU, and the loop reads
        them only on the steps it logs, so the host launches the next step while the GPU works."""
        trainer, position = self.config.trainer, self.position
        if not self.optimization.sampler.fits(position.sample_index, self.samples_per_step):
            position.epoch += 1
            position.sample_index = 0
        consumed: list[int] = []
        step = position.step + 1
        loss_sum = self._pipeline_step(step, consumed) if self.parallel_model.pipelined else 0.0
        batches, scored = self._micro_batches(step, consumed)
        per_token = self.per_token_scale(scored)
        for micro, (x, y) in enumerate(batches):
            loss_sum = loss_sum + self._micro_step(step, micro, x, y, per_token)
        if per_token is not None:  # loss_sum is already this rank's share of the step's token mean
            loss_sum = loss_sum * trainer.grad_accum
        grad_norm = self._optimizer_step(step)
        position.step += 1
        if position.step % self.steps_per_batch == 0:  # an objective's batch may serve several steps
            position.sample_index += self.samples_per_step
        if self.sample_log is not None:
            self.sample_log.record(position.step, position.epoch, consumed)
        self.finite.record(position.step, loss_sum, grad_norm)
        return loss_sum / trainer.grad_accum, grad_norm

    def _rank_indices(self, start: int, consumed: list[int]) -> torch.Tensor:
        indices = self.optimization.sampler.rank_slice(self.position.epoch, start, self.config.trainer.batch_size,
                                                       self.dp_rank)
        if self.sample_log is not None:
            consumed += indices.tolist()
        return indices

    def _pipeline_step(self, step: int, consumed: list[int]) -> torch.Tensor:
        """The whole step's forward and backward through the pipeline schedule (its micro-batches)."""
        batch = self.timed_batch(step, 0, self._rank_indices(self.position.sample_index, consumed))
        self.phase("pipeline schedule", step)
        return self.pipeline_forward(*batch, train=True)

    def _micro_batches(self, step: int, consumed: list[int]) -> tuple[list, list[int] | None]:
        """This rank's micro-batches of the step (none under a pipeline), read before any forward,
        and the tokens each scores when the loss is a mean per token."""
        if self.objective.produces_batches:
            return self._produced_batches(step, consumed), None
        batches, scored = [], [] if self.scores_per_token() else None
        global_micro_batch = self.config.trainer.batch_size * self.layout.dp
        for micro in range(0 if self.parallel_model.pipelined else self.config.trainer.grad_accum):
            start = self.position.sample_index + micro * global_micro_batch
            batches.append(self.timed_batch(step, micro, self._rank_indices(start, consumed), scored))
        return batches, scored

    def _produced_batches(self, step: int, consumed: list[int]) -> list:
        """The objective's batch of the step from this rank's samples of every micro-batch, cut into
        grad_accum micro-batches of its rows ((part, None) each, as (inputs, targets))."""
        grad_accum, global_micro_batch = self.config.trainer.grad_accum, self.config.trainer.batch_size * self.layout.dp
        indices = torch.cat([self._rank_indices(self.position.sample_index + micro * global_micro_batch, consumed)
                             for micro in range(grad_accum)])
        self.phase("rollout", step)
        started = time.perf_counter()
        batch = self.objective.produce_batch(self.context, step, indices, self.raw_model)
        self.timing["data"] += time.perf_counter() - started
        rows = len(batch) // grad_accum
        return [(batch.rows(slice(micro * rows, (micro + 1) * rows)), None) for micro in range(grad_accum)]

    def _micro_step(self, step: int, micro: int, x: torch.Tensor, y: torch.Tensor,
                    per_token: float | None) -> torch.Tensor:
        """One micro-batch's forward and backward; returns its (detached) loss."""
        grad_accum = self.config.trainer.grad_accum
        last = micro == grad_accum - 1
        # Gradients are synchronised only on the last micro-batch; the others accumulate locally.
        with self._sync_context(last), self.loss_context():
            self.phase("forward", step, micro)
            started = time.perf_counter()
            batch = x if self.objective.produces_batches else (x, y, per_token)
            scaled, loss = self.objective.loss(self.context, self.model, batch)
            for term in self.terms:  # what the model adds to any objective, of this micro-batch's forward
                value = term.loss(self.model)
                if value is not None:
                    scaled = scaled + like(scaled, value) / grad_accum
            self.timing["forward"] += time.perf_counter() - started
            self.phase("backward", step, micro)
            self.optimization.scaler.scale(scaled).backward()
        return loss.detach()

    def _optimizer_step(self, step: int) -> torch.Tensor:
        """Unscale, clip, step, schedule; returns the gradient norm before clipping."""
        optimization, trainer = self.optimization, self.config.trainer
        self.phase("optimizer", step)
        optimization.scaler.unscale_(optimization.optimizer)
        max_norm = trainer.grad_clip if trainer.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(list(self.model.parameters()), max_norm, self.place.pp_group)
        optimization.scaler.step(optimization.optimizer)
        for term in self.terms:  # such as DeepSeek-V3's expert-bias update
            term.after_step(self.model)
        optimization.scaler.update()
        optimization.optimizer.zero_grad(set_to_none=True)
        optimization.scheduler.step()
        return grad_norm

    def _sync_context(self, last: bool):
        return contextlib.nullcontext() if last else no_sync(self.model)


def like(loss: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """`term` as a DTensor of `loss`'s mesh and placements where the loss is one (the vocabulary-parallel
    loss of tensor parallelism): a term every rank computed whole, such as the router's loss of
    experts run whole on every rank, whose backward would otherwise meet DTensor gradients."""
    if isinstance(loss, DTensor) and not isinstance(term, DTensor):
        return DTensor.from_local(term, loss.device_mesh, loss.placements, run_check=False)
    return term
