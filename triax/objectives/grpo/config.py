"""The grpo.* keys: Group Relative Policy Optimization (Shao et al. 2024) with TRL's variants
(DAPO, Dr. GRPO, BNPO, GSPO), named and defined as TRL 1.16's GRPOConfig names and defines them,
with TRL's defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from triax.errors import ConfigError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass
class GRPOConfig:
    """GRPO on prompts: sampling, rewards and the clipped, group-relative loss, as TRL's GRPOConfig."""

    num_generations: int = 8
    """Completions sampled per prompt (a group); the advantages are relative within it (at least 2)."""

    max_completion_length: int = 512
    """Tokens a completion may have; one that reaches it without ending is truncated."""

    temperature: float = 1.0
    """Sampling temperature; the log-probabilities of the loss are of the same tempered distribution (as TRL)."""

    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1 = all)."""

    top_k: int = 0
    """Sample among the top_k most probable tokens only (0 = all)."""

    beta: float = 0.0
    """Weight of the KL term to the reference model (0: no reference is built, TRL's default)."""

    num_iterations: int = 1
    """Updates per generated batch (TRL's mu); above 1 the generating policy's log-probabilities are kept."""

    epsilon: float = 0.2
    """Lower clipping bound of the importance ratio: 1 - epsilon."""

    epsilon_high: float | None = None
    """Upper clipping bound: 1 + epsilon_high (unset = epsilon; DAPO recommends 0.28)."""

    loss_type: str = "dapo"
    """dapo (tokens of the whole step) | grpo (per-sequence means) | dr_grpo (max_completion_length) | bnpo
    (tokens of the micro-batch): what the summed token losses are divided by."""

    scale_rewards: str = "group"
    """Advantages divided by the reward std of the group | of the batch | none (Dr. GRPO)."""

    importance_sampling_level: str = "token"
    """token: one importance ratio per token | sequence: one per completion, the mean log-ratio (GSPO)."""

    use_bias_correction_kl: bool = True
    """Multiply the KL term by the importance ratio (DeepSeek-V3.2's unbiased reverse-KL gradient): its
    value is unchanged where the ratio is 1, its gradient is not (TRL's default)."""

    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length without ending out of the loss (DAPO)."""

    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions as `path/to/file.py:function` or `module:function`, or a built-in name
    (exact_match, format)."""

    reward_weights: list[float] | None = None
    """One weight per reward function (unset = 1 each): the reward is their weighted sum."""

    reward_timeout: float = 60.0
    """Seconds one call of a reward function may take; a longer one stops the run, naming it."""

    completion_log: str | None = None
    """A file prefix: each rank appends one JSON line per sampled completion to <prefix>.rank<N> (the step,
    the prompt's sample index and file line, the completion's ids, its rewards and advantage); unset = none."""

    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _need(condition: bool, key: str, value: object, advice: str) -> None:
    if not condition:
        raise ConfigError(f"grpo.{key}={value!r}; {advice}")


def check_grpo(config: GRPOConfig) -> None:
    """Every grpo.* value in range, one line each (before any process or file)."""
    _need(isinstance(config.num_generations, int) and config.num_generations >= 2, "num_generations",
          config.num_generations, "use 2 or more: the advantages compare completions within a group")
    _need(config.max_completion_length >= 1, "max_completion_length", config.max_completion_length,
          "use a positive number of tokens")
    _need(math.isfinite(config.temperature) and config.temperature > 0, "temperature", config.temperature,
          "use a positive temperature such as 1.0")
    _need(math.isfinite(config.top_p) and 0 < config.top_p <= 1, "top_p", config.top_p, "use 0 < top_p <= 1")
    _need(config.top_k >= 0, "top_k", config.top_k, "use 0 (all tokens) or a positive count")
    _need(math.isfinite(config.beta) and config.beta >= 0, "beta", config.beta, "use 0 (no reference) or more")
    _need(config.num_iterations >= 1, "num_iterations", config.num_iterations, "use 1 or more")
    _need(math.isfinite(config.epsilon) and 0 < config.epsilon < 1, "epsilon", config.epsilon,
          "use 0 < epsilon < 1, such as 0.2")
    upper = config.epsilon_upper()
    _need(math.isfinite(upper) and upper > 0, "epsilon_high", config.epsilon_high,
          "use a positive number such as 0.28, or leave it unset")
    _need(config.loss_type in LOSS_TYPES, "loss_type", config.loss_type, f"use one of {', '.join(LOSS_TYPES)}")
    _need(config.scale_rewards in SCALE_REWARDS, "scale_rewards", config.scale_rewards,
          f"use one of {', '.join(SCALE_REWARDS)}")
    _need(config.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level",
          config.importance_sampling_level, f"use one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
    _need(bool(config.reward_funcs), "reward_funcs", config.reward_funcs,
          "name at least one reward, e.g. [exact_match] or [rewards.py:score]")
    weights = config.reward_weights
    _need(weights is None or len(weights) == len(config.reward_funcs), "reward_weights", weights,
          f"give one weight per reward function ({len(config.reward_funcs)}), or leave it unset")
    _need(weights is None or all(math.isfinite(weight) for weight in weights), "reward_weights", weights,
          "use finite numbers")
    _need(math.isfinite(config.reward_timeout) and config.reward_timeout > 0, "reward_timeout",
          config.reward_timeout, "use a positive number of seconds")


def check_grpo_run(config: Any, layout: Any) -> None:
    """What a GRPO run needs of the rest of the configuration, before any process group forms
    (`config`: the TrainConfig; `layout`: its parallel.mesh.Layout)."""
    if config.data.task != "grpo":
        return
    if not config.model.init_from:
        raise ConfigError("data.task=grpo needs model.init_from: a transformers checkpoint directory with "
                          "tokenizer.json (its tokenizer and chat template encode the prompts and decode the answers)")
    if layout.pp > 1 or layout.cp > 1:
        raise ConfigError(f"data.task=grpo does not run under pipeline or context parallelism (parallel.pp={layout.pp}, "
                          f"parallel.cp={layout.cp}): completions are sampled token by token with the whole model on "
                          "each rank; use dp_shard or dp_replicate")
    if config.data.packing:
        raise ConfigError("data.packing=true does not apply to data.task=grpo: each row is one prompt and one "
                          "completion; use data.packing=false")
    iterations, trainer = config.grpo.num_iterations, config.trainer
    # A snapshot inside a block of num_iterations steps would resume without the block's generated batch.
    every = trainer.save_every if trainer.save_every is not None else trainer.eval_every
    if iterations > 1 and every and every % iterations:
        key = "save_every" if trainer.save_every is not None else "eval_every (which save_every follows)"
        raise ConfigError(f"trainer.{key}={every} with grpo.num_iterations={iterations}: a snapshot inside a "
                          "generated batch's steps could not resume it; use a multiple of num_iterations")
    if config.grpo.beta and config.model.lora.rank and config.model.lora.init_from:
        raise ConfigError("grpo.beta > 0 with model.lora.init_from: the reference would be the adapters as read, "
                          "which GRPO does not keep yet; start new adapters or use grpo.beta=0")
