"""GRPO's advantages and loss, as TRL 1.16's GRPOTrainer computes them.

Advantages: each completion's reward (the weighted sum of its reward functions' scores; a function
that returned None is left out of the sum, a completion none of them scored gets no advantage)
minus the mean reward of its group (the num_generations completions of one prompt), divided by
the group's standard deviation (scale_rewards=group), the whole batch's (batch) or not at all
(none), with TRL's 1e-4 added to the deviation.

Loss: per completion token, the importance ratio r = exp(logp - old_logp) (sequence level, GSPO:
one ratio per completion, the exp of its mean log-ratio), and -min(r A, clip(r, 1 - epsilon,
1 + epsilon_high) A), plus beta times the k3 estimate of the KL to the reference,
exp(ref - logp) - (ref - logp) - 1 (times the importance ratio, use_bias_correction_kl, TRL's
default: the reverse KL's unbiased gradient). With one iteration per generated batch old_logp is logp
itself, detached: the ratio is 1, the loss often exactly 0, and only its gradient (A times the
log-probability's) moves the policy. The token losses of the completion mask are then reduced:
grpo: each completion's mean, then the mean over completions; bnpo: the mean over the micro-batch's
tokens; dr_grpo: the sum over (completions x max_completion_length); dapo: the sum over the tokens
of the whole step (every rank and micro-batch), so every layout computes the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triax.objectives.grpo.config import GRPOConfig

STD_FLOOR = 1e-4  # TRL's: added to the reward deviation, so a group of equal rewards divides by it, not by 0


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the values that are not NaN, with Bessel's correction (NaN for
    fewer than two), along `dim` (None: all of them)."""
    dims = tuple(range(values.dim())) if dim is None else (dim,)
    mean = torch.nanmean(values, dim=dims, keepdim=True)
    squares = torch.nanmean((values - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dims, keepdim=True)
    corrected = squares * torch.where(count > 1, count / (count - 1), torch.full_like(squares, float("nan")))
    return corrected.sqrt().squeeze() if dim is None else corrected.sqrt().squeeze(dim)


@dataclass
class Advantages:
    """A batch's advantages and the reward figures TRL logs of it (completions in prompt order, each
    prompt's group together)."""

    advantages: torch.Tensor  # (completions,)
    rewards: torch.Tensor  # (completions,) the weighted sum; NaN where no function scored it
    std_is_zero: torch.Tensor  # (completions,) whether the deviation dividing it is 0


def group_advantages(rewards_per_function: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> Advantages:
    """`rewards_per_function`: (completions, functions) in fp32, NaN where a function returned None."""
    unscorable = torch.isnan(rewards_per_function).all(dim=1)
    rewards = (rewards_per_function * weights.to(rewards_per_function).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = float("nan")
    groups = rewards.view(-1, num_generations)
    group_mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nan_std(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # group, and none (whose deviation is only logged)
        std = nan_std(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - group_mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_FLOOR)
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, std_is_zero)


@dataclass
class TokenTerms:
    """One micro-batch's token losses and what its metrics are made of."""

    token_loss: torch.Tensor  # (completions, tokens), or (completions, 1) at sequence level without KL
    ratio: torch.Tensor  # the importance ratio, (completions, tokens) or (completions, 1)
    kl: torch.Tensor | None  # (completions, tokens); None with beta 0


def token_terms(config: GRPOConfig, logps: torch.Tensor, old_logps: torch.Tensor | None,
                ref_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor) -> TokenTerms:
    """The clipped surrogate and the KL term per token. `logps`: the policy's log-probabilities of
    the completion tokens (with gradient); `old_logps`: the generating policy's (None: logps, detached,
    as with one iteration)."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if config.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.epsilon_upper())
    token_loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if config.beta != 0.0:
        gap = ref_logps - logps
        kl = torch.exp(gap) - gap - 1
        if config.use_bias_correction_kl:  # the ratio is differentiable: it changes the gradient even at 1
            kl = kl * ratio
        token_loss = token_loss + config.beta * kl
    return TokenTerms(token_loss, ratio, kl)


def reduce_loss(config: GRPOConfig, token_loss: torch.Tensor, mask: torch.Tensor, grad_accum: int,
                step_tokens: torch.Tensor | float, data_parallel_size: int,
                steps_per_generation: int | None = None) -> torch.Tensor:
    """This micro-batch's loss, scaled so that the gradients summed over grad_accum micro-batches and
    averaged over data-parallel ranks are the step's. `step_tokens`: the completion tokens in the loss
    over the whole generated batch (every rank), which dapo divides by; `steps_per_generation`: the
    micro-batches one generated batch feeds (unset: grad_accum, one optimizer step)."""
    masked = token_loss * mask
    if config.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / grad_accum
    if config.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / grad_accum
    if config.loss_type == "dr_grpo":
        return masked.sum() / (token_loss.size(0) * config.max_completion_length) / grad_accum
    steps_per_generation = steps_per_generation or grad_accum
    tokens = torch.as_tensor(step_tokens, dtype=torch.float32, device=token_loss.device).clamp(min=1.0)
    return masked.sum() / (tokens / data_parallel_size * grad_accum / steps_per_generation)


def clip_masks(config: GRPOConfig, ratio: torch.Tensor, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where the clipping held the ratio: below 1 - epsilon with a negative advantage, above
    1 + epsilon_high with a positive one, either (TRL's clip_ratio metrics)."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    low = (ratio < 1 - config.epsilon) & (advantages < 0)
    high = (ratio > 1 + config.epsilon_upper()) & (advantages > 0)
    return {"low": low.float(), "high": high.float(), "region": (low | high).float()}
