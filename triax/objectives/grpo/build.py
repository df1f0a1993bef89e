"""GRPO for `triax train`: its prompts read from data.path, and the objective built from the run's
configuration, data and model."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from triax.data.tokenizer import BPETokenizer
from triax.errors import ConfigError
from triax.objectives import RunParts
from triax.objectives.grpo.generation import CachedSampler, SamplingSettings
from triax.objectives.grpo.objective import GRPOObjective
from triax.objectives.grpo.prompts import PromptDataset, load_prompt_datasets, prompt_encoder_for
from triax.objectives.grpo.rewards import load_rewards
from triax.runtime.process_group import is_distributed
from triax.runtime.shared_decisions import any_rank, gather_floats, max_across_ranks


def stop_ids(prompts: PromptDataset) -> tuple[int, ...]:
    """The ids a completion ends at: the checkpoint's eos token, ChatML's end of turn where the chat
    template writes it, and the ids its generation_config.json ends at (as TRL's GRPOTrainer does)."""
    encoder = prompts.encoder
    names = [encoder.eos_token]
    if encoder.template is not None and "<|im_end|>" in encoder.template.source:
        names.append("<|im_end|>")
    ids = {encoder.tokenizer.token_to_id(name) for name in names if name}
    ids.discard(None)
    if not ids:
        raise ConfigError("data.task=grpo: the checkpoint names no eos token (tokenizer_config.json's eos_token), "
                          "so a completion could never end; give the checkpoint one")
    # The tokenizer's first: the first id pads the completions that ended.
    return tuple(sorted(ids)) + tuple(sorted(set(encoder.generation_ends) - ids))


def load_prompts(config: Any, codec: Any, source: Any, run: Any = None) -> tuple[Any, Any, str]:
    """(training prompts, validation prompts, the log's report) of the DataConfig `config`, encoded as
    TRL's GRPOTrainer encodes them (triax.objectives.grpo.prompts); `run`: the TrainConfig, whose
    grpo.max_completion_length is the room a prompt leaves for its completions (0 without one)."""
    if source is None or not isinstance(codec, BPETokenizer):
        raise ConfigError("data.task=grpo needs model.init_from: a transformers checkpoint directory with "
                          "tokenizer.json (its tokenizer and chat template encode the prompts)")
    encoder = prompt_encoder_for(config.chat_template, source.description, source.path, codec.tokenizer)
    prompts = load_prompt_datasets(config.path, config.val_path, config.train_split, encoder, config.block_size,
                                   run.grpo.max_completion_length if run is not None else 0)
    return prompts.train, prompts.val, prompts.report


def build(parts: RunParts) -> GRPOObjective:
    """The objective of the run (`parts.data`: its PromptDatasets and the checkpoint's tokenizer;
    `parts.model`: the policy, unwrapped: it samples in its own layout). Its reference, when
    grpo.beta asks for one, is the run's (use_reference)."""
    config, data = parts.config, parts.data
    grpo, prompts = config.grpo, data.train
    ends = stop_ids(prompts)
    settings = SamplingSettings(grpo.num_generations, grpo.max_completion_length, grpo.temperature, grpo.top_p,
                                grpo.top_k, ends)
    # Sharded weights: every rank takes part in every forward, so the loop runs until all ranks stopped.
    together = is_distributed()
    all_stopped = (lambda stopped_here: not any_rank(not stopped_here)) if together else None
    # Tensor parallelism shards every forward's positions over its ranks: a multiple of them per forward.
    multiple = config.parallel.tp
    window = getattr(getattr(parts.model, "config", None), "sliding_window", None)
    if multiple > 1 and window:
        raise ConfigError(f"data.task=grpo under parallel.tp={multiple} with a sliding-window model (sliding_window="
                          f"{window}): the positions sampling adds to fill the sequence shards would push real keys "
                          "out of the window's cache; use dp_shard or dp_replicate")
    sampler = CachedSampler(parts.model, settings, config.trainer.seed, parts.device, parts.autocast, all_stopped,
                            max_across_ranks if together else None, multiple)
    tokenizer = data.vocab.tokenizer
    # The figures and token counts are over the data-parallel ranks: tensor-parallel peers (the mesh's
    # innermost dimension, consecutive ranks) hold the same samples, so one of each group counts.
    gather = gather_floats if multiple == 1 else (lambda values: gather_floats(values)[::multiple])
    if together and dist.get_rank() % multiple:  # and the first of each group alone logs their completions
        grpo = dataclasses.replace(grpo, completion_log=None)
    objective = GRPOObjective(grpo, prompts, load_rewards(grpo.reward_funcs),
                              lambda ids: tokenizer.decode(ids, skip_special_tokens=True), ends[0], sampler, gather)
    objective.validation, objective.multiple = data.val, multiple
    trainer = config.trainer  # an evaluation's prompts: eval_batches of them per data-parallel rank (0: all)
    objective.eval_limit = trainer.eval_batches * trainer.batch_size * parts.data_parallel_size
    objective.eval_prompts = trainer.batch_size
    return objective
