"""The run a Trainer is given: everything `triax train` derives from its configuration before any
process group exists, in one step. `prepare_run` resolves the run's own copy of the config
(triax.train.resolve: the checkpoint's architecture, the batch fitted to the data, the paths made
absolute), opens model.init_from or trainer.continue_from once, loads the data, checks the layout,
the model's size against this machine and the snapshot place, and creates trainer.run_dir last.
The Trainer then trains the `PreparedRun` as it is: it joins the job and builds the model, never
editing the config.

The order is the dependencies': the data needs the checkpoint's tokenizer, the architecture needs
the data's vocabulary and the layout, the memory check the model's padded vocabulary, and the
batch fit is made after the memory check (which judges the batch as given). Every check runs
before the process group, so a mistake is one message per rank, never a hang in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triax.config.schema import TrainConfig, changed_from_preset, gpt_config, snapshot_root
from triax.config.validate import check_data_layout
from triax.errors import ConfigError
from triax.interop.foreign_run import ForeignRun
from triax.interop.peft.adapter import check_adapter
from triax.models.config import GPTConfig
from triax.models.lora_config import model_target_keys
from triax.objectives.registry import objective_for
from triax.parallel.experts import check_layout as check_expert_layout
from triax.parallel.mesh import (GPU_VOCAB_MULTIPLE, Layout, check_context_parallel, padded_vocab_size,
                                 resolve_layout, validate_layout)
from triax.runs.directory import check_writable_directory
from triax.runtime.host_memory import return_freed_memory_to_os
from triax.runtime.place import Place, detect_place, pick_device
from triax.runtime.precision import Precision
from triax.runtime.rendezvous import restart_count
from triax.runtime.threads import apply_thread_choice
from triax.train import resolve
from triax.train.data import TrainData, build_data
from triax.train.snapshots import check_saved_vocabulary
from triax.train.startup import check_device_memory, check_snapshot_root


@dataclass(frozen=True)
class PreparedRun:
    """One process's run as prepared before the process group: what the Trainer is given."""

    config: TrainConfig
    """The run's own copy of the config, resolved; the caller's is never edited."""
    place: Place
    """This process's place as its launcher states it (the Trainer joins the group)."""
    device: torch.device
    threads: int | None
    """The CPU threads chosen (triax.runtime.threads); None on a GPU."""
    precision: Precision
    init_source: ForeignRun | None
    """model.init_from's (or trainer.continue_from's) run, opened once."""
    changed_shape: dict
    """The shape keys given away from the preset, as typed (before the checkpoint's replaced them)."""
    data: TrainData
    layout: Layout
    model_config: GPTConfig
    """The model this layout builds, its vocabulary padded for it."""
    batch_note: str | None
    """The line that says trainer.batch_size was lowered to fit the data, or None."""
    global_micro_batch: int
    samples_per_step: int
    steps_per_epoch: int
    """Of the data's batches; the objective may serve several steps with one (the Trainer counts)."""
    snapshot_root: str
    restarted: bool
    """Whether torchrun restarted this job: it then continues its own snapshots."""
    resume: bool
    created_run_dir: bool
    """Whether trainer.run_dir was created here (removed again if joining the job fails)."""


def prepare_run(config: TrainConfig, continued: ForeignRun | None = None) -> PreparedRun:
    """`config`: the composed config, never edited; `continued`: trainer.continue_from's run as
    `compose_run` opened it, not opened again."""
    config = resolve.working_copy(config)
    place = detect_place()
    device = pick_device(config.trainer.device, place.local_rank)
    # A CPU run computes with the cores idle at its start (triax.runtime.threads: why), unless OMP_NUM_THREADS says.
    threads = apply_thread_choice(place.local_world_size) if device.type == "cpu" else None
    precision = Precision(config.trainer.precision)
    precision.check_device(device)
    init_source = resolve.open_source(config, continued)
    changed_shape = changed_from_preset(config.model)  # before model.init_from replaces the shape
    data = build_data(config.data, init_source.codec if init_source else None, init_source, config)
    layout = _checked_layout(config, init_source, changed_shape, data, place)
    model_config = _model_config(config, init_source, data, layout, device, place)
    batch_note, global_micro_batch, samples_per_step, steps_per_epoch = _fitted_batch(config, data, layout)
    root, restarted, resume, created_run_dir = _run_places(config, model_config)
    return PreparedRun(config, place, device, threads, precision, init_source, changed_shape, data, layout,
                       model_config, batch_note, global_micro_batch, samples_per_step, steps_per_epoch,
                       root, restarted, resume, created_run_dir)


def _checked_layout(config: TrainConfig, init_source: ForeignRun | None, changed_shape: dict, data: TrainData,
                    place: Place) -> Layout:
    """The layout the data and the model (the checkpoint's architecture taken) run in, checked."""
    trainer, parallel = config.trainer, config.parallel
    layout = resolve_layout(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp,
                            place.world_size, parallel.cp, parallel.ep)
    check_context_parallel(layout, data.block_size, parallel.compile)
    if init_source is not None:
        resolve.take_architecture(config, init_source, changed_shape, data, layout, place.is_main)
    check_data_layout(config, layout)
    if objective_for(config.data.task).scores_answers:
        # Batches of answers cut to their longest row: to a multiple of tp (which splits the sequence).
        data.train.multiple = data.val.multiple = layout.tp
    validate_layout(layout, n_layer=config.model.n_layer, n_head=config.model.n_head,
                    block_size=data.block_size, batch_size=trainer.batch_size,
                    grad_accum=trainer.grad_accum, pp_schedule=parallel.pp_schedule,
                    pp_microbatches=parallel.pp_microbatches, pp_balance=list(parallel.pp_balance),
                    activation_checkpointing=parallel.activation_checkpointing,
                    tie_embeddings=config.model.tie_embeddings, cpu_offload=parallel.cpu_offload,
                    n_kv_head=config.model.n_kv_head, num_experts=config.model.num_experts,
                    arch=config.model.arch)
    return layout


def _model_config(config: TrainConfig, init_source: ForeignRun | None, data: TrainData, layout: Layout,
                  device: torch.device, place: Place) -> GPTConfig:
    """The model this layout builds (its vocabulary padded for it), checked against the memory."""
    # Before the model exists: with FSDP, freed parameter and gradient buffers must go back to
    # the OS rather than stay in glibc's heap, or each rank's memory stays at its step-time high
    # (see the function). Off by default without sharding: a small model's many activation
    # buffers would each cost fresh pages, for memory it does not need.
    release = config.trainer.return_freed_memory
    if release if release is not None else layout.dp_shard > 1:
        return_freed_memory_to_os()
    # A checkpoint to start from fixes the vocabulary and the context (the data may use less).
    vocab_size, block_size = data.vocab_size, data.block_size
    if init_source is not None:
        vocab_size, block_size = (init_source.architecture[key] for key in ("vocab_size", "block_size"))
    check_saved_vocabulary(config, vocab_size)
    # This layout's own padding: a snapshot saved with another loads by its real rows.
    padded_rows = padded_vocab_size(vocab_size, layout.tp, GPU_VOCAB_MULTIPLE if device.type == "cuda" else 1)
    model_config = gpt_config(config.model, vocab_size, block_size, padded_rows if padded_rows != vocab_size else None)
    check_expert_layout(model_config, layout, config.parallel.activation_checkpointing)
    check_device_memory(config, model_config, layout, device, place, data.block_size)
    return model_config


def _fitted_batch(config: TrainConfig, data: TrainData, layout: Layout) -> tuple[str | None, int, int, int]:
    """(the batch note, the global micro-batch, the samples of one step, the steps of an epoch):
    one step's samples, which the training set must hold at least once."""
    trainer = config.trainer
    # A batch larger than the data is lowered to fit, with a line (triax.train.batch_fit: why).
    note = resolve.fit_batch(config, len(data.train), layout.dp)
    # Tensor- and pipeline-parallel peers read the same samples: only data parallelism widens the batch.
    global_micro_batch = trainer.batch_size * layout.dp
    samples_per_step = global_micro_batch * trainer.grad_accum
    steps_per_epoch = len(data.train) // samples_per_step
    if steps_per_epoch == 0:
        raise ConfigError(
            f"one step needs {samples_per_step} samples (batch_size {trainer.batch_size} x "
            f"{layout.dp} data-parallel ranks x grad_accum {trainer.grad_accum}) but the training "
            f"set has {len(data.train)}; lower trainer.batch_size or grad_accum")
    return note, global_micro_batch, samples_per_step, steps_per_epoch


def _run_places(config: TrainConfig, model_config: GPTConfig) -> tuple[str, bool, bool, bool]:
    """(the snapshot root, whether torchrun restarted the job, whether the run resumes, whether
    trainer.run_dir was created here): where the snapshots go, whether older ones may be resumed
    or replaced, and trainer.run_dir itself, created last."""
    trainer = config.trainer
    # A restart by torchrun (--max-restarts) continues this job's own snapshots whatever
    # trainer.resume says: with resume=false the first attempt refused or cleared older ones.
    restarted = restart_count() > 0
    resume = trainer.resume or restarted
    check_snapshot_root(config, snapshot_root(config), resume)
    if config.model.lora.rank:  # the targets this model's family adapts, before the run directory is written
        model_target_keys(config.model.lora.targets, model_config)
    if config.model.lora.rank and config.model.lora.init_from:
        check_adapter(model_config, config.model.lora)  # before the run directory is written
    # Created only once every check above passed: a refused start leaves no empty run directory.
    created_run_dir = check_writable_directory(trainer.run_dir, "trainer.run_dir")
    # Checked as typed (the errors above name what the user wrote), kept absolute: config.yaml
    # then serves `triax eval`, `generate` and a resume from any directory.
    resolve.absolute(config)
    return snapshot_root(config), restarted, resume, created_run_dir
