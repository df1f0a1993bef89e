"""Checking a composed training config: every value's range, once, before any file or process
group exists; and the checks of the data against the layout the config resolves to (the
process count decides it)."""

from __future__ import annotations

import math
import os
import re

import torch

from triax.data.tokens import TOKEN_DTYPES
from triax.errors import ConfigError
from triax.models.family import spec_of
from triax.models.lora_config import check_lora
from triax.parallel.comm_hooks import check_compression
from triax.parallel.mesh import ACTIVATION_CHECKPOINTING, PP_SCHEDULES, Layout
from triax.runtime.precision import POLICY_NAMES
from triax.runtime.timeouts import collective_timeout
from triax.tracking.trackers import check_trackers
from triax.config.schema import (DECAY_RULES, SCHEDULES, DataConfig, DebugConfig, ModelConfig, OptimConfig,
                                 ParallelConfig, TrainConfig, TrainerConfig, gpt_config)
from triax.objectives.registry import OBJECTIVES, objective_for, sections


def _need(ok: bool, key: str, value: object, what: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid; {what}")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


DEVICE_HELP = "use auto, cpu, cuda or cuda:N"


def _check_device(requested: str) -> None:
    """Syntax only (auto | cpu | cuda | cuda:N); whether CUDA exists is checked where it is used."""
    if requested == "auto":
        return
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError, TypeError):
        device = None
    _need(device is not None and device.type in ("cpu", "cuda"), "trainer.device", requested, DEVICE_HELP)


def validate(config: TrainConfig) -> None:
    """Every value's range, checked here once, before any file or process group exists."""
    _check_model(config.model)
    _check_data(config.data)
    _check_optim(config.optim)
    _check_trainer(config.trainer)
    _check_parallel(config.parallel)
    _check_debug(config.debug)
    for task, entry in OBJECTIVES.items():  # each objective's keys (triax.objectives.registry)
        if entry.check_settings is not None and (entry.check_always or config.data.task == task):
            entry.check_settings(getattr(config, entry.section))
    check_sections_apply(config)


def check_sections_apply(config: TrainConfig) -> None:
    """The config sections that belong to one data.task: keys set there on a run of another task
    would change nothing, so the slip (the task, or a key left from another recipe) is refused."""
    for section, task in sections().items():
        given = getattr(config, section)
        default = type(given)()
        if config.data.task == task or given == default:
            continue
        changed = [f"{section}.{key}={value!r}" for key, value in vars(given).items()
                   if value != getattr(default, key)]
        raise ConfigError(f"{', '.join(changed)} with data.task={config.data.task}: the {section}.* keys apply to "
                          f"data.task={task} only; set data.task={task} or leave them out")


def _check_model(model: ModelConfig) -> None:
    # GPTConfig owns the shape's rules; the data's sizes are checked in _check_data.
    gpt_config(model, vocab_size=1, block_size=1)
    check_lora(model.lora)


def _check_data(data: DataConfig) -> None:
    objective_for(data.task)  # one line naming the tasks there are
    _need(data.truncation_mode in ("keep_start", "keep_end"), "data.truncation_mode", data.truncation_mode,
          "use keep_start or keep_end")
    _need(data.overlong in ("truncate", "drop"), "data.overlong", data.overlong, "use truncate or drop")
    # Characters and addition problems are one stream with no documents: packing would change nothing.
    _need(not data.packing or data.task not in ("char", "addition"), "data.packing", data.packing,
          f"packing keeps documents apart in data.task=tokens or chat; data.task={data.task} has no documents")
    _need(data.vocab_size is None or data.vocab_size >= 1, "data.vocab_size", data.vocab_size,
          "use 1 or more (or leave it unset to take meta.json's)")
    _need(data.token_dtype is None or data.token_dtype in TOKEN_DTYPES, "data.token_dtype", data.token_dtype,
          f"use one of {', '.join(TOKEN_DTYPES)}")
    _need(data.path is None or data.path.strip() != "", "data.path", data.path,
          "give a file (or leave it unset for the built-in corpus)")
    _need(data.block_size >= 1, "data.block_size", data.block_size, "use 1 or more")
    _need(_finite(data.train_split) and 0 < data.train_split < 1, "data.train_split", data.train_split,
          "use a fraction between 0 and 1 (the tail is the validation set)")
    _need(_finite(data.truncate) and 0 < data.truncate <= 1, "data.truncate", data.truncate, "use 0 < truncate <= 1")
    _need(data.digits >= 1, "data.digits", data.digits, "use 1 or more")
    if data.sources:
        _check_sources(data)
    _need(data.eot_token is None or data.eot_token >= 0, "data.eot_token", data.eot_token,
          "use a token id (0 or more), e.g. 50256 for GPT-2's <|endoftext|>")


# A mixture source's name becomes part of metric names (val_loss/NAME): a plain word.
SOURCE_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"


def _check_sources(data: DataConfig) -> None:
    """A mixture: token sources only, instead of data.path, each with a positive weight."""
    _need(data.task == "tokens", "data.task", data.task, "data.sources (a mixture) is for data.task=tokens")
    _need(not data.path and not data.val_path, "data.path", data.path,
          "give either data.path (one source) or data.sources (a mixture), and each source its own val_path")
    for number, source in enumerate(data.sources):
        key = f"data.sources.{number}"
        _need(bool(source.path and source.path.strip()), f"{key}.path", source.path, "give the source's path")
        _need(_finite(source.weight) and source.weight > 0, f"{key}.weight", source.weight,
              "use a positive number (remove a source rather than giving it weight 0)")
        _need(source.name is None or re.fullmatch(SOURCE_NAME, source.name) is not None, f"{key}.name",
              source.name, "use letters, digits, '_', '-' and '.' (it names val_loss/NAME in the log and "
              "TensorBoard, where '/' would nest)")
    names = source_names(data)
    repeated = sorted({name for name in names if names.count(name) > 1})
    _need(not repeated, "data.sources names", repeated, "give each source a name of its own (name: ...)")


def source_names(data: DataConfig) -> list[str]:
    """Each mixture source's name in the log: its own, else the last part of its path."""
    return [source.name or os.path.basename(source.path.rstrip("/")).split("*")[0].rstrip("_-.") or str(number)
            for number, source in enumerate(data.sources)]


def _check_optim(optim: OptimConfig) -> None:
    _need(_finite(optim.lr) and optim.lr > 0, "optim.lr", optim.lr, "use a positive learning rate such as 1e-3")
    _need(optim.min_lr is None or (_finite(optim.min_lr) and 0 <= optim.min_lr <= optim.lr), "optim.min_lr",
          optim.min_lr, f"use 0 <= min_lr <= optim.lr ({optim.lr}), or leave it unset for optim.lr / 10")
    _need(optim.warmup_steps >= 0, "optim.warmup_steps", optim.warmup_steps, "use 0 or more")
    _need(optim.decay in DECAY_RULES, "optim.decay", optim.decay, f"use one of {', '.join(DECAY_RULES)}")
    _need(optim.schedule in SCHEDULES, "optim.schedule", optim.schedule, f"use one of {', '.join(SCHEDULES)}")
    _need(optim.decay_steps is None or optim.decay_steps >= 1, "optim.decay_steps", optim.decay_steps,
          "use 1 or more, or leave it unset for the run's length")
    _need(_finite(optim.eps) and optim.eps > 0, "optim.eps", optim.eps, "use a number above 0, e.g. 1e-8")
    _need(len(optim.betas) == 2, "optim.betas", optim.betas, "give two values, e.g. [0.9,0.95]")
    _need(all(_finite(beta) and 0 <= beta < 1 for beta in optim.betas), "optim.betas", optim.betas,
          "each beta must be in [0, 1)")
    _need(_finite(optim.weight_decay) and optim.weight_decay >= 0, "optim.weight_decay", optim.weight_decay,
          "use 0 or more")


def _check_trainer(trainer: TrainerConfig) -> None:
    if trainer.max_steps is None and trainer.max_epochs is None:
        raise ConfigError("set trainer.max_steps or trainer.max_epochs (both are null)")
    for name in ("max_steps", "max_epochs"):
        value = getattr(trainer, name)
        _need(value is None or value >= 1, f"trainer.{name}", value, "use 1 or more (or null)")
    for name in ("batch_size", "grad_accum", "log_every", "max_save_failures"):
        _need(getattr(trainer, name) >= 1, f"trainer.{name}", getattr(trainer, name), "use 1 or more")
    _need(trainer.save_every is None or trainer.save_every >= 0, "trainer.save_every", trainer.save_every,
          "use 0 or more (or leave it unset to snapshot at every evaluation)")
    for name in ("eval_every", "eval_batches", "keep_last", "sample_tokens"):
        _need(getattr(trainer, name) >= 0, f"trainer.{name}", getattr(trainer, name), "use 0 or more")
    _need(_finite(trainer.grad_clip) and trainer.grad_clip >= 0, "trainer.grad_clip", trainer.grad_clip,
          "use 0 (no clipping) or a positive norm")
    _need(trainer.precision in POLICY_NAMES, "trainer.precision", trainer.precision,
          f"use one of {', '.join(POLICY_NAMES)}")
    _need(0 <= trainer.seed < 2**63, "trainer.seed", trainer.seed, "use 0 .. 2**63-1")
    _need(trainer.peak_flops is None or (_finite(trainer.peak_flops) and trainer.peak_flops > 0), "trainer.peak_flops",
          trainer.peak_flops, "use a positive FLOP/s figure such as 3.12e14, or leave it unset")
    _need(_finite(trainer.stop_grace) and trainer.stop_grace > 0, "trainer.stop_grace", trainer.stop_grace,
          "use a positive number of seconds")
    _check_device(trainer.device)
    _need(trainer.run_dir.strip() != "", "trainer.run_dir", trainer.run_dir, "give a directory")
    # A name with bytes that are not UTF-8 (a surrogate escape from the command line) breaks the
    # trackers that write it (TensorBoard's event files) after the run's files were made.
    for key, value in (("trainer.run_dir", trainer.run_dir), ("trainer.snapshot_dir", trainer.snapshot_dir)):
        _need(value is None or _utf8(value), key, value, "give a name in UTF-8 (it holds bytes that are not)")
    _need(trainer.snapshot_dir is None or trainer.snapshot_dir.strip() != "", "trainer.snapshot_dir",
          trainer.snapshot_dir, "give a directory or URL, or leave it unset for <run_dir>/snapshots")
    if trainer.collective_timeout is not None:
        collective_timeout(trainer.collective_timeout)  # raises with the key and value if not positive
    check_trackers(trainer.loggers, "trainer.loggers")  # names known, packages installed
    _need(trainer.project.strip() != "", "trainer.project", trainer.project, "give a project name")


def _check_parallel(parallel: ParallelConfig) -> None:
    for name in ("dp_replicate", "dp_shard"):
        value = getattr(parallel, name)
        _need(value == -1 or value >= 1, f"parallel.{name}", value, "use 1 or more, or -1 for the rest")
    for name in ("tp", "pp"):
        _need(getattr(parallel, name) >= 1, f"parallel.{name}", getattr(parallel, name), "use 1 or more")
    _need(parallel.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", parallel.pp_schedule,
          f"use one of {', '.join(PP_SCHEDULES)}")
    _need(parallel.pp_microbatches >= 0, "parallel.pp_microbatches", parallel.pp_microbatches,
          "use 0 (2 x pp) or more")
    _need(all(layers >= 1 for layers in parallel.pp_balance), "parallel.pp_balance", parallel.pp_balance,
          "every stage needs 1 or more layers")
    _need(parallel.activation_checkpointing in ACTIVATION_CHECKPOINTING, "parallel.activation_checkpointing",
          parallel.activation_checkpointing, f"use one of {', '.join(ACTIVATION_CHECKPOINTING)}")
    _need(_finite(parallel.bucket_mb) and parallel.bucket_mb > 0, "parallel.bucket_mb", parallel.bucket_mb,
          "use a positive size in MB")
    _need(parallel.max_logits_mb is None or (_finite(parallel.max_logits_mb) and parallel.max_logits_mb >= 0),
          "parallel.max_logits_mb",
          parallel.max_logits_mb, "use a size in MB such as 256, or 0 for no limit")
    check_compression(parallel.grad_compression, parallel.powersgd_rank)


def _check_debug(debug: DebugConfig) -> None:
    _need(debug.preempt_at_step is None or debug.preempt_at_step >= 1, "debug.preempt_at_step",
          debug.preempt_at_step, "use a positive step (or null)")
    _need(debug.preempt_rank >= 0, "debug.preempt_rank", debug.preempt_rank, "use 0 or more")


def check_data_layout(config: TrainConfig, layout: Layout) -> None:
    """The data options the layout the config resolves to cannot run (one line each), before any
    process group exists."""
    data = config.data
    if data.task in ("chat", "tokens") and data.packing and layout.pp > 1:
        raise ConfigError("data.packing=true does not run under pipeline parallelism (parallel.pp="
                          f"{layout.pp}): its stages take the token ids alone; use data.packing=false")
    if (data.task in ("chat", "tokens") and data.packing and layout.tp > 1
            and spec_of(config.model.arch).model.learned_positions):
        # A learned position table (GPT-2's) is split for positions of one sequence, not per-row positions.
        raise ConfigError("data.packing=true with GPT-2 (learned positions) does not run under tensor "
                          "parallelism; use data.packing=false or parallel.tp=1")
    # Chat batches cut to their longest row: not under a pipeline (its stages are built for one row
    # length) nor context parallelism (each row is cut into chunks of the block).
    if data.task == "chat" and data.batch_padding and layout.cp > 1:
        raise ConfigError("data.batch_padding=true does not run under context parallelism (parallel.cp="
                          f"{layout.cp}): each row is cut into 2 x cp chunks of the block; use "
                          "data.batch_padding=false")
    if data.task == "chat" and data.batch_padding and layout.pp > 1:
        raise ConfigError("data.batch_padding=true does not run under pipeline parallelism (parallel.pp="
                          f"{layout.pp}): its stages are built for one row length; use "
                          "data.batch_padding=false")
    entry = objective_for(data.task)
    if entry.check_run is not None:  # what the task's objective needs (triax.objectives.registry)
        entry.check_run(config, layout)
