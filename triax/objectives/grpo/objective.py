"""GRPO as an objective (triax.objectives): the rollout produces a step's batch, the loss runs on
its micro-batches.

The rollout of a step samples num_generations completions of each of this rank's prompts
(generation.Sampler), decodes them as TRL does (skip the special tokens; a conversational prompt's
completion is one assistant message), scores them with every reward function (scoring.score),
and turns the rewards into group-relative advantages (loss.group_advantages). A prompt's group is
sampled and scored on one rank, so its advantages need no other rank; scale_rewards=batch, the
dapo token count and the logged figures take every rank's (`gather`). With num_iterations > 1 the
generating policy's log-probabilities are kept; with beta > 0 the reference's are computed then,
under the reference (`reference`: a model of its own, or a context that makes the policy the
reference, such as LoRA's adapters switched off).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, ContextManager, Sequence

import torch

from triax import safe_files
from triax.errors import ConfigError
from triax.objectives import StepContext
from triax.objectives.grpo.config import GRPOConfig, check_grpo
from triax.objectives.grpo.generation import Completion, Sampler
from triax.objectives.grpo.logprobs import DEFAULT_CHUNK_TOKENS, completion_logps
from triax.objectives.grpo.loss import clip_masks, group_advantages, reduce_loss, token_terms
from triax.objectives.grpo.metrics import LossFigures
from triax.objectives.grpo.prompts import Prompt, PromptDataset
from triax.objectives.grpo.rewards import RewardFunction
from triax.objectives.grpo.rollout import (Rollout, completion_tensors, length_figures, pad_rows,
                                           reward_figures)
from triax.objectives.grpo.scoring import score
from triax.objectives.reference import Reference
from triax.tracking.line_fields import LineField

# This rank's floats (as many on every rank) -> every data-parallel rank's, in rank order.
Gather = Callable[[list[float]], list[list[float]]]


def _alone(values: list[float]) -> list[list[float]]:
    return [values]


class GRPOObjective:
    """GRPO's rollout and loss on a triax decoder (see the module docstring)."""

    # What a user of TRL watches, on the step line and the bar under the record's names: the mean
    # reward of the step's completions, its spread and how long the completions are.
    line_fields = (LineField("reward", ".3f"), LineField("reward_std", ".3f"),
                   LineField("completions/mean_length", ".1f"))
    produces_batches = True  # the rollout: completions sampled for the step's prompts, and scored
    mean_per_token = False  # its loss_type decides the reduction (loss.reduce_loss)
    text_samples = False  # its evaluation samples completions of its own

    def __init__(self, config: GRPOConfig, prompts: PromptDataset, rewards: Sequence[RewardFunction],
                 decode: Callable[[list[int]], str], pad_id: int, sampler: Sampler, gather: Gather = _alone,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        check_grpo(config)
        self.config, self.prompts, self.rewards, self.decode = config, prompts, list(rewards), decode
        self.pad_id, self.sampler, self.gather, self.chunk_tokens = pad_id, sampler, gather, chunk_tokens
        weights = config.reward_weights or [1.0] * len(self.rewards)
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.reference: torch.nn.Module | None = None  # a frozen model of its own (full fine-tuning)
        self.reference_context: Callable[[], ContextManager] = contextlib.nullcontext  # LoRA: adapters off
        self.figures = LossFigures()
        self.rollout_figures: list[dict[str, float]] = []  # each step's, since the last log line
        self.validation: PromptDataset | None = None  # held-out prompts for `evaluate`
        self.eval_limit = 0  # how many of them an evaluation takes (0: all; trainer.eval_batches' prompts)
        self.eval_prompts = 8  # held-out prompts sampled together (trainer.batch_size)
        self.steps_per_batch = config.num_iterations  # optimizer steps each generated batch trains (TRL's)
        self.multiple = 1  # positions per forward: a multiple of this (tensor-parallel ranks)
        # num_iterations > 1: (the step that generated it, the batch), reused until its block of steps ends
        self.kept: tuple[int, Rollout] | None = None

    # ---- the interface ------------------------------------------------------------------------------

    def check(self, layout: Any) -> None:
        if getattr(layout, "pp", 1) > 1 or getattr(layout, "cp", 1) > 1:
            raise ConfigError("GRPO samples completions token by token with the whole model on each rank; it does "
                              "not run under pipeline or context parallelism (use dp_shard or tp)")

    def needs_reference(self) -> bool:
        return self.config.beta != 0.0

    def use_reference(self, reference: Reference) -> None:
        """The run's reference (triax.objectives.reference): a model of its own, or the policy switched."""
        self.reference, self.reference_context = reference.model, reference.switched

    def produce_batch(self, context: StepContext, step: int, indices: torch.Tensor,
                      model: torch.nn.Module | None = None) -> Rollout:
        """The rollout of this rank's prompts `indices` at optimizer step `step` (counted from 1), by
        `model` (the policy). With num_iterations > 1, as TRL: steps come in blocks of num_iterations; the
        first of a block generates (the step reads the same `indices` through the block) and the others
        train on that batch again, its generating policy's log-probabilities kept for the ratio. A run
        resumed inside a block has lost its batch: it generates it again, from the block's first step's
        places but under the resumed weights (as TRL does; snapshots fall on block boundaries, checked)."""
        first = step - (step - 1) % self.steps_per_batch
        if self.kept is not None and self.kept[0] == first:
            return self.kept[1]
        rollout = self._generated(context, first, indices, model)
        self.kept = (first, rollout) if self.steps_per_batch > 1 else None
        return rollout

    def _generated(self, context: StepContext, step: int, indices: torch.Tensor,
                   model: torch.nn.Module | None) -> Rollout:
        prompts = self.prompts.records(indices)
        completions = self.sampler.complete([prompt.ids for prompt in prompts], indices.tolist(), step)
        rollout = self._scored(prompts, completions, context.data_parallel_rank)
        self.rollout_figures.append(rollout.figures)
        if self.config.completion_log:
            self._log_completions(context.data_parallel_rank, step, indices.tolist(), prompts, rollout)
        rollout = self._to_device(rollout, context.device)
        if model is not None and self.config.num_iterations > 1:
            rollout.old_logps = self._logps(context, model, rollout, reference=False)
        if model is not None and self.needs_reference():
            rollout.ref_logps = self._logps(context, model, rollout, reference=True)
        return rollout

    def loss(self, context: StepContext, model: torch.nn.Module,
             batch: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's loss, scaled for grad_accum micro-batches and the data-parallel mean (and
        as logged: the step's sum over its micro-batches, so times grad_accum)."""
        with context.autocast():
            logps, entropies = completion_logps(model, batch.prompt_ids, batch.prompt_lengths, batch.completion_ids,
                                                self.config.temperature, self.chunk_tokens, self.multiple)
        mask = batch.completion_mask
        terms = token_terms(self.config, logps, batch.old_logps, batch.ref_logps, batch.advantages, mask)
        loss = reduce_loss(self.config, terms.token_loss, mask, context.grad_accum, batch.step_tokens,
                           context.data_parallel_size)
        self.figures.add(terms, clip_masks(self.config, terms.ratio, batch.advantages), entropies, mask)
        return loss, loss * context.grad_accum

    def take_figures(self) -> dict[str, float]:
        """The figures since the last call, as TRL logs them: each step's rollout figures averaged over
        the steps, and the loss figures (a collective through `gather`: every rank calls it)."""
        steps, self.rollout_figures = self.rollout_figures, []
        names = steps[0] if steps else {}
        means = {name: sum(figures[name] for figures in steps) / len(steps) for name in names}
        return {**means, **self.figures.take(self.gather)}

    @torch.no_grad()
    def evaluate(self, context: StepContext) -> dict:
        """val_reward: the mean weighted reward of num_generations sampled completions of every held-out
        prompt; val_pass_rate: the share of them that every reward function scored in full (a weighted
        reward of at least the weights' sum: for 0/1 rewards such as exact_match, all passed). The prompts
        are dealt to the data-parallel ranks; every rank samples as many (a slot past the end: not counted)."""
        validation = self.validation
        ranks, rank = context.data_parallel_size, context.data_parallel_rank
        count = min(len(validation), self.eval_limit) if self.eval_limit else len(validation)
        per_rank = -(-count // ranks)
        total, passed, scored = 0.0, 0.0, 0.0
        full = float(self.weights.clamp(min=0).sum())
        generations = self.config.num_generations
        # eval_prompts prompts are sampled together (a completion's randomness is its place, so how they
        # are batched changes nothing); every rank makes the same number of calls.
        for first in range(0, per_rank, self.eval_prompts):
            indices = [rank * per_rank + start for start in range(first, min(first + self.eval_prompts, per_rank))]
            counted = [index < count for index in indices]
            prompts = validation.records([index if inside else 0 for index, inside in zip(indices, counted)])
            completions = self.sampler.complete([prompt.ids for prompt in prompts], indices, step=-1)
            table = self._reward_table(validation, prompts, completions)
            rewards = (table * self.weights.unsqueeze(0)).nansum(dim=1).view(len(prompts), generations)
            rewards = rewards[torch.tensor(counted, dtype=torch.bool)]
            total, passed = total + float(rewards.sum()), passed + float((rewards >= full).sum())
            scored += rewards.numel()
        sums = [sum(column) for column in zip(*self.gather([total, passed, scored]))]
        return {"val_reward": sums[0] / max(sums[2], 1.0), "val_pass_rate": sums[1] / max(sums[2], 1.0),
                "val_completions": round(sums[2])}

    # ---- the rollout --------------------------------------------------------------------------------

    def _completions_as_given(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list:
        """Completions as TRL hands them to rewards: text, or one assistant message for a conversation."""
        generations = self.config.num_generations
        out = []
        for row, completion in enumerate(completions):
            text = self.decode(completion.ids)
            conversational = isinstance(prompts[row // generations].prompt, list)
            out.append([{"role": "assistant", "content": text}] if conversational else text)
        return out

    def _reward_table(self, dataset: PromptDataset, prompts: Sequence[Prompt],
                      completions: Sequence[Completion]) -> torch.Tensor:
        """[completions x reward functions]: every reward function's score of each completion of `prompts`
        (num_generations each, in order), called as TRL calls it with the records' other fields."""
        repeated = [prompt for prompt in prompts for _ in range(self.config.num_generations)]
        return score(self.rewards, [prompt.prompt for prompt in repeated],
                     self._completions_as_given(prompts, completions), [completion.ids for completion in completions],
                     dataset.columns(prompts, self.config.num_generations), [prompt.where for prompt in repeated],
                     self.config.reward_timeout)

    def _scored(self, prompts: Sequence[Prompt], completions: Sequence[Completion], rank: int) -> Rollout:
        generations = self.config.num_generations
        repeated = [prompt for prompt in prompts for _ in range(generations)]
        table = self._reward_table(self.prompts, prompts, completions)
        # Every rank's rewards: batch scaling and the logged figures are over the whole batch.
        everyone = self.gather(table.flatten().tolist())
        all_rewards = torch.tensor([value for values in everyone for value in values]).view(-1, len(self.rewards))
        scored = group_advantages(all_rewards, self.weights, generations, self.config.scale_rewards)
        start = rank * len(completions)
        completion_ids, mask = completion_tensors(completions, self.pad_id, self.config.mask_truncated_completions)
        lengths = self.gather([float(len(completion.ids)) for completion in completions]
                              + [float(completion.truncated) for completion in completions]
                              + [float(mask.sum())])
        step_tokens = sum(values[-1] for values in lengths)
        every_length = [value for values in lengths for value in values[:(len(values) - 1) // 2]]
        every_truncated = [bool(value) for values in lengths for value in values[(len(values) - 1) // 2:-1]]
        figures = {**length_figures(every_length, every_truncated),
                   **reward_figures([reward.name for reward in self.rewards], all_rewards, self.weights,
                                    scored.std_is_zero)}
        prompt_ids = pad_rows([prompt.ids for prompt in repeated], self.pad_id, left=True)
        rollout = Rollout(prompt_ids, torch.tensor([len(prompt.ids) for prompt in repeated]), completion_ids, mask,
                          scored.advantages[start:start + len(completions)], step_tokens, figures=figures,
                          completions=[completion.ids for completion in completions])
        rollout.rewards = [[None if value != value else value for value in row] for row in table.tolist()]
        return rollout

    def _log_completions(self, rank: int, step: int, numbers: list[int], prompts: Sequence[Prompt],
                         rollout: Rollout) -> None:
        """One JSON line per completion, appended to grpo.completion_log's file of this rank."""
        generations = self.config.num_generations
        lines = []
        for row, ids in enumerate(rollout.completions):
            prompt = row // generations
            lines.append(json.dumps({"step": step, "sample": numbers[prompt], "record": prompts[prompt].where,
                                     "generation": row % generations, "completion_ids": ids,
                                     "rewards": rollout.rewards[row], "advantage": float(rollout.advantages[row])}))
        with safe_files.open_append(f"{self.config.completion_log}.rank{rank}") as handle:
            handle.write("".join(line + "\n" for line in lines))

    @staticmethod
    def _to_device(rollout: Rollout, device: torch.device) -> Rollout:
        for name in ("prompt_ids", "prompt_lengths", "completion_ids", "completion_mask", "advantages"):
            setattr(rollout, name, getattr(rollout, name).to(device))
        return rollout

    @torch.no_grad()
    def _logps(self, context: StepContext, model: torch.nn.Module, rollout: Rollout, reference: bool) -> torch.Tensor:
        scoring_model = self.reference if reference and self.reference is not None else model
        switch = self.reference_context if reference and self.reference is None else contextlib.nullcontext
        with switch(), context.loss_context(), context.autocast():  # loss_context: as the loss's forward
            logps, _ = completion_logps(scoring_model, rollout.prompt_ids, rollout.prompt_lengths,
                                        rollout.completion_ids, self.config.temperature, self.chunk_tokens,
                                        self.multiple)
        return logps
