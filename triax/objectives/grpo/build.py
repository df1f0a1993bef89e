"""GRPO for `triax train`: the objective built from the run's configuration, data and model."""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch

from triax.errors import ConfigError
from triax.models.lora import adapters_disabled
from triax.objectives.grpo.generation import CachedSampler, SamplingSettings
from triax.objectives.grpo.objective import GRPOObjective
from triax.objectives.grpo.prompts import PromptDataset
from triax.objectives.grpo.rewards import load_rewards
from triax.runtime.process_group import is_distributed
from triax.runtime.shared_decisions import any_rank, gather_floats, max_across_ranks


def stop_ids(prompts: PromptDataset) -> tuple[int, ...]:
    """The ids a completion ends at: the checkpoint's eos token, and ChatML's end of turn where the
    chat template writes it (the end-of-turn and end-of-text of the issue's families)."""
    encoder = prompts.encoder
    names = [encoder.eos_token]
    if encoder.template is not None and "<|im_end|>" in encoder.template.source:
        names.append("<|im_end|>")
    ids = {encoder.tokenizer.token_to_id(name) for name in names if name}
    ids.discard(None)
    if not ids:
        raise ConfigError("data.task=grpo: the checkpoint names no eos token (tokenizer_config.json's eos_token), "
                          "so a completion could never end; give the checkpoint one")
    return tuple(sorted(ids))


def build_grpo(config: Any, data: Any, model: torch.nn.Module, device: torch.device,
               autocast: Callable[[], ContextManager], lora: bool, data_parallel_size: int) -> GRPOObjective:
    """`config`: the TrainConfig; `data`: its TrainData (PromptDatasets, the checkpoint's tokenizer);
    `model`: the policy, unwrapped (it samples in its own layout); `lora`: the reference is the base
    with the adapters off (else the trainer gives the objective a frozen copy, objective.reference)."""
    grpo, prompts = config.grpo, data.train
    ends = stop_ids(prompts)
    settings = SamplingSettings(grpo.num_generations, grpo.max_completion_length, grpo.temperature, grpo.top_p,
                                grpo.top_k, ends)
    # Sharded weights: every rank takes part in every forward, so the loop runs until all ranks stopped.
    together = is_distributed()
    all_stopped = (lambda stopped_here: not any_rank(not stopped_here)) if together else None
    sampler = CachedSampler(model, settings, config.trainer.seed, device, autocast, all_stopped,
                            max_across_ranks if together else None)
    tokenizer = data.vocab.tokenizer
    objective = GRPOObjective(grpo, prompts, load_rewards(grpo.reward_funcs),
                              lambda ids: tokenizer.decode(ids, skip_special_tokens=True), ends[0], sampler,
                              gather_floats)
    objective.validation = data.val
    trainer = config.trainer  # an evaluation's prompts: eval_batches of them per data-parallel rank (0: all)
    objective.eval_limit = trainer.eval_batches * trainer.batch_size * data_parallel_size
    objective.eval_prompts = trainer.batch_size
    if lora:
        objective.reference_context = adapters_disabled
    return objective
