"""A GRPO step's batch: the completions sampled for its prompts, scored, as padded tensors.

Rows are completions, prompt after prompt, each prompt's num_generations together (TRL's order);
prompts left-padded, completions right-padded, with the completion mask the loss sums over (a
truncated completion's is all zero under grpo.mask_truncated_completions, as TRL's). The figures
TRL logs of a generation batch (completion lengths, rewards) are kept with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from triax.objectives.grpo.generation import Completion
from triax.objectives.grpo.loss import nan_std


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (rows, prompt width) left-padded
    prompt_lengths: torch.Tensor  # (rows,)
    completion_ids: torch.Tensor  # (rows, completion width) right-padded
    completion_mask: torch.Tensor  # (rows, completion width) 1 where the loss counts the token
    advantages: torch.Tensor  # (rows,)
    step_tokens: float = 0.0  # the loss's completion tokens over every rank (dapo divides by it)
    old_logps: torch.Tensor | None = None  # the generating policy's (num_iterations > 1)
    ref_logps: torch.Tensor | None = None  # the reference's (beta > 0)
    figures: dict[str, float] = field(default_factory=dict)
    completions: list[list[int]] = field(default_factory=list)  # each row's sampled ids, for the run's log
    rewards: list[list[float | None]] = field(default_factory=list)  # each row's reward per function

    def __len__(self) -> int:
        return self.completion_ids.size(0)

    def rows(self, part: slice) -> "Rollout":
        """A micro-batch of it: the rows in `part`, the step's figures and token count kept."""
        pick = lambda tensor: None if tensor is None else tensor[part]  # noqa: E731
        return replace(self, prompt_ids=self.prompt_ids[part], prompt_lengths=self.prompt_lengths[part],
                       completion_ids=self.completion_ids[part], completion_mask=self.completion_mask[part],
                       advantages=self.advantages[part], old_logps=pick(self.old_logps),
                       ref_logps=pick(self.ref_logps), completions=self.completions[part],
                       rewards=self.rewards[part])


def pad_rows(rows: Sequence[list[int]], pad_id: int, left: bool) -> torch.Tensor:
    """(rows, longest) ids, padded with pad_id on the left (prompts) or the right (completions)."""
    width = max(1, max(len(row) for row in rows))
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            where = slice(width - len(row), width) if left else slice(0, len(row))
            out[index, where] = torch.tensor(row, dtype=torch.long)
    return out


def completion_tensors(completions: Sequence[Completion], pad_id: int,
                       mask_truncated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = pad_rows([completion.ids for completion in completions], pad_id, left=False)
    lengths = torch.tensor([len(completion.ids) for completion in completions])
    mask = (torch.arange(ids.size(1))[None, :] < lengths[:, None]).int()
    if mask_truncated:
        kept = torch.tensor([not completion.truncated for completion in completions])
        mask = mask * kept[:, None].int()
    return ids, mask


def length_figures(all_lengths: Sequence[int], all_truncated: Sequence[bool]) -> dict[str, float]:
    """TRL's completions/* figures of a generation batch (every rank's completions)."""
    lengths = torch.tensor(all_lengths, dtype=torch.float32)
    truncated = torch.tensor(all_truncated, dtype=torch.bool)
    ended = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1)
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()}


def reward_figures(names: Sequence[str], table: torch.Tensor, weights: torch.Tensor,
                   std_is_zero: torch.Tensor) -> dict[str, float]:
    """TRL's reward figures of a generation batch: each function's mean and std over the completions
    it scored, the weighted reward's, and the share of completions whose group's rewards were equal."""
    figures: dict[str, float] = {}
    for column, name in enumerate(names):
        figures[f"rewards/{name}/mean"] = torch.nanmean(table[:, column]).item()
        figures[f"rewards/{name}/std"] = nan_std(table[:, column]).item()
    rewards = (table * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(table).all(dim=1)] = math.nan
    figures["reward"] = torch.nanmean(rewards).item()
    figures["reward_std"] = nan_std(rewards).item()
    figures["frac_reward_zero_std"] = std_is_zero.float().mean().item()
    return figures
