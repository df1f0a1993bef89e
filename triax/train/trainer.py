"""The trainer behind `triax train`: a thin door over the core (runtime, precision, data,
parallel, checkpoint, metrics).

Each step takes the next global batch in the data order (see triax.data.sampler), runs
`grad_accum` micro-batches with gradient sync only on the last, then clips, steps and schedules.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from triax import checkpoint, safe_files
from triax.runtime.failure_agreement import raise_together
from triax.checkpoint.rng import seed_everything
from triax.runtime.shared_decisions import any_rank, gather_floats, mean_across_ranks
from triax.data import GlobalSampler
from triax.data.addition import IGNORE_INDEX, addition_accuracy
from triax.errors import ConfigError, printable
from triax.eval.windows import evaluation_windows, mask_unscored, rank_batches
from triax.runtime.host_memory import host_memory_bytes, return_freed_memory_to_os
from triax.tracking.throughput import MetricsLogger, Pace, duration, peak_memory_mb, stated_peak_flops, step_count
from triax.models import build_model, vocabulary_rows
from triax.models.lora import apply_lora, trainable_summary
from triax.interop.peft.adapter import check_adapter, load_adapter
from triax.train.optim import make_adamw, make_schedule, move_schedule
from triax.parallel.ddp import unwrap
from triax.parallel.experts import check_layout as check_expert_layout
from triax.parallel.grad_clip import clip_grad_norm
from triax.parallel.context_parallel import local_chunks
from triax.parallel.mesh import (GPU_VOCAB_MULTIPLE, build_mesh, check_context_parallel, padded_vocab_size,
                                 resolve_layout, validate_layout)
from triax.parallel.no_sync import no_sync
from triax.parallel.parallelize import parallelize
from triax.parallel.plan import ModelShape, check_memory
from triax.runtime.place import detect_place, pick_device
from triax.runtime.precision import Precision
from triax.runtime.process_group import init_distributed
from triax.runtime.rendezvous import restart_count
from triax.runtime.stragglers import StragglerCheck
from triax.runtime.threads import apply_thread_choice
from triax.runtime.timeouts import collective_timeout, slow_phase_timeout
from triax.train import continuation, init_from, router_metrics
from triax.train.batch_fit import fit_batch_size
from triax.train.config import (TrainConfig, absolute_paths, asynchronous_snapshots, changed_from_preset,
                                continuation_overrides, final_lr, gpt_config, snapshot_every, snapshot_root, to_dict)
from triax.train.data import build_data
from triax.train.dpo import DPOObjective, check_preference_run
from triax.train.loss import loss_function
from triax.train.preemption import StopRequest
from triax.train.run_lock import LOCK_NAME, lock_run_dir, unlock_run_dir
from triax.train.sample_log import SampleLog
from triax.runtime.watchdog import Watchdog


def check_writable_directory(path: str, key: str) -> bool:
    """Create `path` if needed and prove we can write there. Returns whether we created it (so a
    failed start can remove it again and leave nothing behind)."""
    existed = os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        safe_files.real_directory(path)
        probe = os.path.join(path, f".write_probe_{os.getpid()}")
        safe_files.remove_file(probe)
        with safe_files.create_new(probe) as handle:
            handle.write(b"ok")
        os.remove(probe)
    except OSError as error:
        raise ConfigError(f"{key} {path!r} is not writable ({error.strerror or error}); "
                          "choose a directory you can write to") from None
    return not existed


class Trainer:
    """One process's part of a `triax train` job. Every process of the job builds one from the same
    checked config (`compose_config`); the constructor checks the layout, builds this rank's model
    shards, data, optimizer and metrics, and resumes from the newest good snapshot when
    `trainer.resume` is set. `fit()` then trains to `trainer.max_steps` / `max_epochs`:

        from triax.train import Trainer, compose_config

        Trainer(compose_config(["model=gpt-nano", "trainer.max_steps=100"])).fit()
    """

    def __init__(self, config: TrainConfig):
        self.config = config
        model_config, created_run_dir = self._check_inputs()
        self._join_job(created_run_dir)
        if config.trainer.preflight:
            # deferred: triax.doctor reads triax.train.config, whose package imports this module
            from triax.doctor.command import preflight

            preflight(config, self.place, self.device)
        self._build_model(model_config)
        self._build_optimizer()
        # The position in training: optimizer steps taken, epoch, and the global sample index
        # within the epoch where the next step starts.
        self.step = 0
        self.epoch = 0
        self.sample_index = 0
        self.save_failures = 0  # consecutive failed snapshot writes
        self.last_snapshot: str | None = None
        self.saved_step: int | None = None  # the step of the newest snapshot this process wrote or loaded
        self.pending_save: checkpoint.PendingSnapshot | None = None  # trainer.async_save: the write in flight
        self.pending_step: int | None = None
        self.resume_stats: dict = {}  # bytes_read: what this rank read of the snapshot it resumed from
        self.stop_reason: str | None = None  # set when a signal stopped the run early
        self.first_step = True  # compiles and sets up lazily: the watchdog gives it the slow allowance
        self.timing = {"step": 0.0, "data": 0.0, "forward": 0.0}  # this rank's seconds in the log interval
        self._router_term = None  # a mixture of experts' router losses of the last forward (router_metrics)
        # Chat and preference rows vary: this rank's training tokens of the log interval, counted as
        # read (the positions computed, padding included; the targets the loss sees).
        self.counted = [0, 0]
        self.stragglers = StragglerCheck()
        self.sample_log = SampleLog(config.debug.sample_log, self.rank) if config.debug.sample_log else None
        self._peak_flops = stated_peak_flops(self.device, self.precision.compute_dtype, config.trainer.peak_flops)
        self._mfu_warned = False
        self._said_why_no_sample = False
        self._open_run_files(created_run_dir)
        self.continued_best: tuple[float, int] | None = None  # the best val loss of the run continued
        if self.resume:
            self._maybe_resume()
        elif config.trainer.overwrite:
            with raise_together(f"deleting the old snapshots in {self.snapshot_root}"):
                if self.is_main:
                    checkpoint.remove_snapshots(self.snapshot_root)
        if config.trainer.continue_from and self.saved_step is None:
            self._continue_run()

    # ---- the phases of __init__ ----------------------------------------------------------------

    def _check_inputs(self):
        """Everything about the input, before any process group exists; returns the model's config
        and whether the run directory was created here."""
        config, trainer, parallel = self.config, self.config.trainer, self.config.parallel
        # Everything that can be wrong with the input is checked before the process group
        # exists, so a mistake is one message per rank, never a hang in a collective.
        self.place = detect_place()
        self.device = pick_device(trainer.device, self.place.local_rank)
        # A CPU run computes with the cores idle at its start (triax.runtime.threads: why), unless OMP_NUM_THREADS says.
        self.threads = apply_thread_choice(self.place.local_world_size) if self.device.type == "cpu" else None
        self.precision = Precision(trainer.precision)
        self.precision.check_device(self.device)
        self.init_source = self._init_source()
        self.changed_shape = changed_from_preset(config.model)  # before model.init_from replaces the shape
        self.data = build_data(config.data, self.init_source.codec if self.init_source else None, self.init_source)
        self.layout = resolve_layout(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp,
                                     self.place.world_size, parallel.cp)
        check_context_parallel(self.layout, self.data.block_size, parallel.compile)
        if self.init_source is not None:
            self._take_architecture()
        if config.data.task == "chat" and config.data.packing and self.layout.pp > 1:
            raise ConfigError("data.packing=true does not run under pipeline parallelism (parallel.pp="
                              f"{self.layout.pp}): its stages take the token ids alone; use data.packing=false")
        if config.data.task == "chat" and config.data.packing and self.layout.tp > 1 and config.model.arch == "gpt2":
            # GPT-2's learned position table is split for positions of one sequence, not per-row positions.
            raise ConfigError("data.packing=true with GPT-2 (learned positions) does not run under tensor "
                              "parallelism; use data.packing=false or parallel.tp=1")
        check_preference_run(config, self.layout)
        # DPO on preference pairs: its loss replaces the token loss (triax.train.dpo).
        self.dpo = DPOObjective(config.dpo) if config.data.task == "preference" else None
        self._check_batch_padding()
        validate_layout(self.layout, n_layer=config.model.n_layer, n_head=config.model.n_head,
                        block_size=self.data.block_size, batch_size=trainer.batch_size,
                        grad_accum=trainer.grad_accum, pp_schedule=parallel.pp_schedule,
                        pp_microbatches=parallel.pp_microbatches, pp_balance=list(parallel.pp_balance),
                        activation_checkpointing=parallel.activation_checkpointing,
                        tie_embeddings=config.model.tie_embeddings, cpu_offload=parallel.cpu_offload,
                        n_kv_head=config.model.n_kv_head)
        # Before the model exists: with FSDP, freed parameter and gradient buffers must go back to
        # the OS rather than stay in glibc's heap, or each rank's memory stays at its step-time high
        # (see the function). Off by default without sharding: a small model's many activation
        # buffers would each cost fresh pages, for memory it does not need.
        release = trainer.return_freed_memory
        if release if release is not None else self.layout.dp_shard > 1:
            return_freed_memory_to_os()
        # A checkpoint to start from fixes the vocabulary and the context (the data may use less).
        vocab_size, block_size = self.data.vocab_size, self.data.block_size
        if self.init_source is not None:
            vocab_size, block_size = (self.init_source.architecture[key] for key in ("vocab_size", "block_size"))
        self._check_saved_vocabulary(vocab_size)
        # This layout's own padding: a snapshot saved with another loads by its real rows.
        padded_rows = padded_vocab_size(vocab_size, self.layout.tp,
                                        GPU_VOCAB_MULTIPLE if self.device.type == "cuda" else 1)
        model_config = gpt_config(config.model, vocab_size, block_size,
                                  padded_rows if padded_rows != vocab_size else None)
        check_expert_layout(model_config, self.layout, parallel.ep, parallel.cpu_offload)  # before any group forms
        self._check_memory(model_config)
        # A batch larger than the data is lowered to fit, with a line (triax.train.batch_fit: why).
        trainer.batch_size, self.batch_note = fit_batch_size(trainer.batch_size, len(self.data.train),
                                                             self.layout.dp, trainer.grad_accum)
        # Tensor- and pipeline-parallel peers read the same samples: only data parallelism widens the batch.
        self.global_micro_batch = trainer.batch_size * self.layout.dp
        self.samples_per_step = self.global_micro_batch * trainer.grad_accum
        self.steps_per_epoch = len(self.data.train) // self.samples_per_step
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"one step needs {self.samples_per_step} samples (batch_size {trainer.batch_size} x "
                f"{self.layout.dp} data-parallel ranks x grad_accum {trainer.grad_accum}) but the training "
                f"set has {len(self.data.train)}; lower trainer.batch_size or grad_accum")
        self.snapshot_root = snapshot_root(config)
        default_root = os.path.join(trainer.run_dir, "snapshots")
        if trainer.snapshot_dir is None and os.path.lexists(default_root):
            try:  # a planted link would send snapshot writes, prunes and overwrite's deletes elsewhere
                safe_files.real_directory(default_root)
            except safe_files.UnsafeFileError as error:
                raise ConfigError(f"{error}; or name the place explicitly with trainer.snapshot_dir") from None
        # A restart by torchrun (--max-restarts) continues this job's own snapshots whatever
        # trainer.resume says: with resume=false the first attempt refused or cleared older ones.
        self.restarted = restart_count() > 0
        self.resume = trainer.resume or self.restarted
        if not self.resume and not trainer.overwrite:
            existing = checkpoint.latest_snapshot(self.snapshot_root)
            if existing is not None:
                raise ConfigError(
                    f"trainer.resume=false but {self.snapshot_root!r} already holds a run (newest snapshot "
                    f"{existing}); resume it (trainer.resume=true), choose another trainer.run_dir, or add "
                    "trainer.overwrite=true to delete its snapshots and start over")
        if config.model.lora.rank and config.model.lora.init_from:
            check_adapter(model_config, config.model.lora)  # before the run directory is written
        # Created only once every check above passed: a refused start leaves no empty run directory.
        created_run_dir = check_writable_directory(trainer.run_dir, "trainer.run_dir")
        # Checked as typed (the errors above name what the user wrote), kept absolute: config.yaml
        # then serves `triax eval`, `generate` and a resume from any directory.
        absolute_paths(config)
        self.snapshot_root = snapshot_root(config)
        return model_config, created_run_dir

    def _check_memory(self, model_config) -> None:
        """A model, batch and context this device cannot hold stop here, before anything is
        allocated (triax plan's estimate, without the runtime), instead of swapping for hours."""
        trainer, parallel = self.config.trainer, self.config.parallel
        if self.device.type == "cuda":
            properties = torch.cuda.get_device_properties(self.device)
            memory, where = properties.total_memory, f"{self.device} ({properties.name})"
        else:
            memory = host_memory_bytes()
            processes = self.place.local_world_size
            where = "this host" if processes == 1 else f"each of this host's {processes} processes"
            memory = memory // processes if memory else None
        if memory is None:
            return
        shape = ModelShape.from_config(model_config, block_size=self.data.block_size)
        check_memory(shape, self.layout, memory / 2**30, where, batch_size=trainer.batch_size,
                     precision=trainer.precision, checkpointing=parallel.activation_checkpointing,
                     pp_schedule=parallel.pp_schedule, microbatches=parallel.pp_microbatches)

    def _check_batch_padding(self) -> None:
        """Chat and preference batches cut to their longest row: to a multiple of tp (which splits
        the sequence); not under a pipeline (its stages are built for one row length)."""
        data = self.config.data
        if data.task in ("chat", "preference"):
            self.data.train.multiple = self.data.val.multiple = self.layout.tp
        if data.task == "chat" and data.batch_padding and self.layout.cp > 1:
            raise ConfigError("data.batch_padding=true does not run under context parallelism (parallel.cp="
                              f"{self.layout.cp}): each row is cut into 2 x cp chunks of the block; use "
                              "data.batch_padding=false")
        if data.task == "chat" and data.batch_padding and self.layout.pp > 1:
            raise ConfigError("data.batch_padding=true does not run under pipeline parallelism (parallel.pp="
                              f"{self.layout.pp}): its stages are built for one row length; use "
                              "data.batch_padding=false")

    def _join_job(self, created_run_dir: bool) -> None:
        """The watchdog and the process group."""
        trainer = self.config.trainer
        # The watchdog enforces trainer.collective_timeout on each step phase and names the rank a
        # hang waits for; the process group's own timeout covers the slow phases (start-up, snapshots).
        self.collective_timeout = collective_timeout(trainer.collective_timeout)
        self.watchdog = None
        try:
            if self.place.world_size > 1:
                self.watchdog = Watchdog(trainer.run_dir, self.collective_timeout, self.place.rank,
                                         self.place.world_size)
                if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                    # torchrun's store exists before the process group: a rank that never arrives
                    # is named here instead of waited for inside init_process_group.
                    self.watchdog.start()
            self.place = init_distributed(self.device, self.place,
                                          timeout_s=slow_phase_timeout(self.collective_timeout))
            if self.watchdog is not None and not self.watchdog.started:
                self.watchdog.start()
            if self.watchdog is not None:
                # Stopped when this trainer goes away, even if the rest of __init__ fails and the
                # caller goes on: a forgotten watchdog would end the process later.
                weakref.finalize(self, self.watchdog.stop)
        except Exception:
            if self.watchdog is not None:
                self.watchdog.stop()
            if created_run_dir and self.place.is_main:
                _remove_if_empty(trainer.run_dir)
            raise
        self.rank, self.world_size = self.place.rank, self.place.world_size
        self.is_main = self.rank == 0
        self.dp_rank = self.layout.dp_rank(self.rank)
        self.cp_rank = self.layout.coordinates(self.rank)["cp"]  # which part of each sequence this rank holds

    def _build_model(self, model_config) -> None:
        """This rank's part of the model, in its layout, from the seed (or model.init_from)."""
        trainer, parallel = self.config.trainer, self.config.parallel
        seed_everything(trainer.seed)
        self.model_config = model_config
        self._pipeline_reduction = "mean"  # what _pipeline_loss returns: "sum" while evaluating
        with torch.device("meta"):  # the whole model's shape, for counting; no memory
            described = build_model(model_config)
        self.num_params = described.num_params()
        self.trainable_params = 0
        if self.config.model.lora.rank:
            apply_lora(described, self.config.model.lora)
            self.trainable_params = trainable_summary(described)[0]
        self.flops_per_token = described.flops_per_token(self.data.block_size)
        self.mesh = build_mesh(self.layout, self.device.type)
        # Each rank allocates only its own part of the model; the initial weights depend on the seed
        # alone (not on the layout), so they equal the single-process model's.
        self.parallel_model = parallelize(model_config, self.layout, self.mesh, self.precision, parallel, self.device,
                                          seed=trainer.seed, loss_fn=self._pipeline_loss, rank=self.rank,
                                          lora=self.config.model.lora)
        self.model = self.parallel_model.model
        # The plain GPT to call for evaluation and sampling (sharded in place by TP/FSDP); a
        # pipeline rank holds only stages of it and evaluates through the schedule instead.
        self.raw_model = None if self.parallel_model.pipelined else unwrap(self.model)
        # The loss is compiled with the blocks; not on vocabulary-sharded logits (loss_parallel's
        # DTensor rules) nor on a pipeline's last stage (the schedule calls it with its own shapes).
        self._token_loss = loss_function(parallel.compile and not self.parallel_model.loss_parallel
                                         and not self.parallel_model.pipelined)
        if self.init_source is not None:
            # Before the optimizer exists; a resumed run's snapshot then replaces these weights.
            init_from.load_weights(self.init_source, self.raw_model if self.raw_model is not None else self.model,
                                   model_config, self._stored_name())
        if self.config.model.lora.rank and self.config.model.lora.init_from:
            load_adapter(self.raw_model if self.raw_model is not None else self.model,
                         self.config.model.lora.init_from, self.config.model.lora, self._stored_name(),
                         n_layer=model_config.n_layer)
            if self.dpo is not None:  # DPO's reference: the adapters as read (TRL's "ref" adapter)
                self.dpo.keep_initial_adapters(self.raw_model)
        if self.dpo is not None and not self.config.model.lora.rank:
            self.dpo.reference = self._frozen_reference(model_config)
        self.pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        # A different random stream per rank from here on, so dropout masks differ across ranks.
        seed_everything(trainer.seed + 1000 * self.rank)

    def _frozen_reference(self, model_config):
        """DPO without LoRA: a second model from model.init_from, built and sharded as the policy
        (each rank holds its part alone), frozen, never in the optimizer or the snapshots."""
        # Without DDP's wrapper (nothing to synchronise: it has no gradients); FSDP and TP shard in place.
        reference = unwrap(parallelize(model_config, self.layout, self.mesh, self.precision, self.config.parallel,
                                       self.device, seed=self.config.trainer.seed, rank=self.rank).model)
        init_from.load_weights(self.init_source, reference, model_config, self._stored_name())
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference.eval()

    def _build_optimizer(self) -> None:
        """AdamW over this rank's parameters, the schedule, the loss scaler and the data order."""
        optim, parallel = self.config.optim, self.config.parallel
        # With parallel.cpu_offload the shards, their gradients and so the optimizer step live on the host.
        optimizer_device = torch.device("cpu") if parallel.cpu_offload else self.device
        self.optimizer = make_adamw(self.raw_model if self.raw_model is not None else self.model,
                                    optim.lr, optim.weight_decay, optim.betas, optimizer_device,
                                    decay=optim.decay, fused=optim.fused, eps=optim.eps)
        self.sampler = GlobalSampler(len(self.data.train), seed=self.config.trainer.seed,
                                     shuffle=self.config.data.shuffle)
        self.total_steps = self._total_steps()
        self.scheduler = make_schedule(self.optimizer, optim.decay_steps or self.total_steps, optim.warmup_steps,
                                       final_lr(optim), optim.schedule)
        self.scaler = self.precision.make_scaler(self.device)
        self.save_every = snapshot_every(self.config.trainer)
        self.async_save = asynchronous_snapshots(self.config.trainer, self.device)

    def _open_run_files(self, created_run_dir: bool) -> None:
        """The run lock, the trackers, and the files generate/export need (rank 0 writes them).
        A start that fails here (a full disk) removes what it created, and nothing else."""
        trainer = self.config.trainer
        existing = set(os.listdir(trainer.run_dir)) if self.is_main else set()
        # Rank 0 alone writes these; the ranks agree before the next collective (the resume), so
        # a failure there stops every rank at once instead of leaving the others waiting.
        with raise_together(f"writing the run files in {trainer.run_dir}"):
            try:
                if self.is_main:
                    lock_run_dir(trainer.run_dir)  # before anything in it is written or deleted
                    weakref.finalize(self, unlock_run_dir, trainer.run_dir, True)  # a Trainer never fitted
                self.logger = MetricsLogger(
                    trainer.run_dir, enabled=self.is_main, loggers=trainer.loggers,
                    project=trainer.project, config=to_dict(self.config),
                    run_name=trainer.run_name or os.path.basename(os.path.normpath(trainer.run_dir)))
                if self.is_main:
                    self._write_run_files()
            except OSError as error:
                if self.is_main:
                    if getattr(self, "logger", None) is not None:
                        self.logger.close()
                    _remove_new_entries(trainer.run_dir, existing | {LOCK_NAME})
                    unlock_run_dir(trainer.run_dir, remove=True)
                    if created_run_dir:
                        _remove_if_empty(trainer.run_dir)
                raise ConfigError(f"cannot write {error.filename or 'the run files'} in trainer.run_dir "
                                  f"({error.strerror or error}); fix it or choose another run directory") from None

    # ---- set-up helpers ------------------------------------------------------------------------

    def _init_source(self):
        """model.init_from (or trainer.continue_from), resolved and checked before any process group exists."""
        path = self.config.model.init_from or self.config.trainer.continue_from
        if not path:
            return None
        source = init_from.resolve(path, self.config.model)
        if self.config.trainer.continue_from:
            continuation.check(source, self.config)
        if source.codec is None and self.config.data.task == "char":
            family = source.architecture.get("arch", "gpt2")
            tokenizer = ("GPT-2's tokenizer.json" if family == "gpt2" else
                         f"the {family} model's own tokenizer.json (its tokenizer's save_pretrained writes it)")
            raise ConfigError(f"model.init_from={path!r} has no tokenizer.json, so text cannot be encoded for it; "
                              f"put {tokenizer} there, or train on token files (data.task=tokens)")
        if source.is_triax_run and self.config.model.lora.rank:
            # A LoRA run's snapshots hold only trainable tensors: a triax run's base would not load.
            raise ConfigError(f"model.lora with model.init_from={path!r} (a triax run) is not supported; export the "
                              "run with `triax export RUN OUT --format hf` and start from OUT")
        return source

    def _take_architecture(self) -> None:
        """The checkpoint's shape replaces model.* (dropout stays this run's choice)."""
        source, model = self.init_source, self.config.model
        init_from.check_fits(source, self.data.vocab_size, self.data.block_size)
        # The config is otherwise strict: a shape key given beside model.init_from is not dropped silently.
        ignored = [key for key, value in self.changed_shape.items()
                   if key in source.architecture and source.architecture[key] != value]
        if ignored and self.place.is_main:
            given = ", ".join(f"model.{key}={self.changed_shape[key]}" for key in ignored)
            taken = ", ".join(f"{key}={source.architecture[key]}" for key in ignored)
            print(f"triax: warning: {given} ignored: model.init_from={printable(source.path)!r} decides the model's "
                  f"shape ({taken}); leave the shape keys out beside model.init_from", file=sys.stderr, flush=True)
        for key, value in source.architecture.items():
            if key not in ("vocab_size", "block_size"):  # the data's sizes, checked above
                setattr(model, key, value)
        if model.tie_embeddings and (self.layout.tp > 1 or self.layout.pp > 1):
            # Tensor and pipeline parallelism need an untied head: it starts as a copy of the
            # embedding (the same logits), and the two then train apart.
            model.tie_embeddings = False
            source.architecture = dict(source.architecture, tie_embeddings=False)
            if self.place.is_main:
                print(f"triax: warning: model.init_from={printable(source.path)!r} ties the head to the embedding; with tensor or pipeline "
                      "parallelism they are untied (the head starts as a copy) and train separately",
                      file=sys.stderr, flush=True)

    def _check_saved_vocabulary(self, vocab_size: int) -> None:
        """A resume reads the first vocab_size rows of the snapshot's embedding and head, whatever
        padding it was saved with: refuse, before any process group, a snapshot of another
        vocabulary (its rows would name other tokens). Read from the newest snapshot's validated
        state; a damaged one is left to the resume, which falls back from it and says why."""
        if not (self.config.trainer.resume or restart_count() > 0):
            return
        snapshot = checkpoint.latest_snapshot(snapshot_root(self.config))
        if snapshot is None:
            return
        try:
            saved = checkpoint.read_state(snapshot).get("model")
        except checkpoint.SnapshotError:
            return
        saved = saved.get("vocab_size") if isinstance(saved, dict) else None
        if type(saved) is int and saved != vocab_size:
            raise ConfigError(f"snapshot {snapshot} was trained on a vocabulary of {saved} tokens, this run's has "
                              f"{vocab_size}; resume with the data (or model.init_from) it was trained on, or train "
                              "this one in another trainer.run_dir")

    def _total_steps(self) -> int:
        limits = []
        if self.config.trainer.max_steps is not None:
            limits.append(self.config.trainer.max_steps)
        if self.config.trainer.max_epochs is not None:
            limits.append(self.config.trainer.max_epochs * self.steps_per_epoch)
        return min(limits)

    def _write_run_files(self) -> None:
        """What `triax generate` and `triax export` need besides the weights."""
        import json

        import yaml

        run_dir = self.config.trainer.run_dir
        # Atomic, never through a planted link: a link's target outside the run stays untouched.
        safe_files.write_atomic(os.path.join(run_dir, "config.yaml"),
                                yaml.safe_dump(to_dict(self.config), sort_keys=False))
        safe_files.write_atomic(os.path.join(run_dir, "model.json"), json.dumps(self.model_config.__dict__, indent=1))
        if self.data.tokenizer_path is not None:
            # The run carries its tokenizer, so generate/export need nothing but the run dir.
            safe_files.write_atomic(os.path.join(run_dir, "tokenizer.json"), self.data.vocab.json_text)
        elif self.data.vocab is not None:
            safe_files.write_atomic(os.path.join(run_dir, "vocab.json"), self.data.vocab.to_json())
        # A transformers model.init_from's config and tokenizer files, for a drop-in `--format hf` export.
        init_from.keep_description(self.init_source, run_dir)

    def _warn(self, message: str) -> None:
        if self.is_main:
            print(f"triax: warning: {printable(message)}", file=sys.stderr, flush=True)

    def _maybe_resume(self) -> None:
        found = checkpoint.load_latest_snapshot(self.snapshot_root, self.model, self.optimizer, report=self._warn,
                                                stored_name=self._stored_name(), check_state=self._check_state,
                                                stats=self.resume_stats, real_rows=vocabulary_rows(self.model_config))
        if found is None:
            if self.restarted:
                self.logger.print(f"restart: no snapshot in {self.snapshot_root} yet, starting from step 0")
            return
        snapshot, state = found
        self.step, self.epoch, self.sample_index = state["step"], state["epoch"], state["sample_index"]
        try:
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise checkpoint.SnapshotError(f"snapshot {snapshot}: its scheduler or scaler state does not fit "
                                           f"this run ({type(error).__name__}: {error})") from None
        self.saved_step, self.last_snapshot = self.step, snapshot
        saved_world = state.get("world_size", self.world_size)
        layout = f", saved by {saved_world} process(es), now {self.world_size}" if saved_world != self.world_size else ""
        self.logger.print(f"resuming from {snapshot}: step {self.step}/{self.total_steps}, epoch {self.epoch}, "
                          f"global sample {self.sample_index}{layout}")
        changed = _changed_keys(state.get("config", {}), to_dict(self.config))
        if changed:
            self.logger.print("config differs from the snapshot's: " + ", ".join(changed))

    def _continue_run(self) -> None:
        """trainer.continue_from: the other tool's AdamW state, step and best val loss, on top of
        the weights init_from loaded; the schedule moves to that step (its settings came with the
        config). A run already at or past its end says so, as a resumed one does."""
        source = self.init_source
        model = self.raw_model if self.raw_model is not None else self.model
        # The notes first, while the checkpoint read for the config is still held: load() lets a
        # Trainer's go, and asking afterwards would read its whole optimizer.pt again.
        _, notes = continuation_overrides(self.config)
        get_optimizer_state_dict(model, self.optimizer)  # creates AdamW's state, to be overwritten
        self.step, self.continued_best = continuation.load(source, model, self.optimizer, self.model_config,
                                                           self._stored_name())
        move_schedule(self.scheduler, self.step)
        best = f", best val loss {self.continued_best[0]:.4f}" if self.continued_best is not None else ""
        self.logger.print(f"continuing {source.tool_name} run {source.path} at step {self.step}/"
                          f"{self.total_steps}{best}: its AdamW state and schedule "
                          f"(lr {self.scheduler.get_last_lr()[0]:.3e} next)" + "".join(f"; {note}" for note in notes))

    def save(self) -> str | None:
        """Write a snapshot of this step. On a storage fault: report it, keep training, and return
        None (the next interval retries); after trainer.max_save_failures failures in a row, raise.
        With trainer.async_save the write goes on in the background: this waits for the previous
        one first (at most one in flight) and returns None until `finish_pending_save` says more."""
        trainer = self.config.trainer
        if self.saved_step == self.step or self.pending_step == self.step:
            return self.last_snapshot if self.saved_step == self.step else None
        self.finish_pending_save()
        state = {"epoch": self.epoch, "sample_index": self.sample_index,
                 "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                 "config": to_dict(self.config), "model": dict(self.model_config.__dict__)}
        self._phase("snapshot", self.step)
        try:
            pending = checkpoint.start_snapshot(self.snapshot_root, self.step, self.model, self.optimizer, state,
                                                keep_last=trainer.keep_last, stored_name=self._stored_name(),
                                                asynchronous=self.async_save)
        except checkpoint.SnapshotWriteError as error:
            self._save_failed(error)
            return None
        self.pending_save, self.pending_step = pending, self.step
        if self.async_save:
            return None
        return self.finish_pending_save()

    def finish_pending_save(self) -> str | None:
        """Wait for the snapshot in flight, if any; returns its path, or None if it failed (reported)."""
        if self.pending_save is None:
            return None
        pending, step = self.pending_save, self.pending_step
        self.pending_save = self.pending_step = None
        try:
            path = pending.wait()
        except checkpoint.SnapshotWriteError as error:
            self._save_failed(error)
            return None
        self.save_failures = 0
        self.saved_step, self.last_snapshot = step, path
        return path

    def _save_failed(self, error: Exception) -> None:
        trainer = self.config.trainer
        self.save_failures += 1
        last_good = self.last_snapshot or "none yet"
        # Agreed by every rank (a collective), so all stop or all go on: a rank may hold only
        # another rank's "failed elsewhere" and not know the cause.
        if any_rank(not getattr(error, "retryable", True)):
            raise checkpoint.SnapshotWriteError(
                f"{error}; not a storage fault, so another attempt would fail the same way: the run stops "
                f"(last good snapshot: {last_good})", retryable=False) from None
        if self.save_failures >= trainer.max_save_failures:
            raise checkpoint.SnapshotWriteError(
                f"{error}; {self.save_failures} snapshot attempts in a row failed (trainer.max_save_failures="
                f"{trainer.max_save_failures}), so the run stops rather than train unprotected. Free space or "
                f"fix permissions at {self.snapshot_root}, then start again; last good snapshot: {last_good}") from None
        self._warn(f"{error}; training goes on and retries at the next save "
                   f"({self.save_failures}/{trainer.max_save_failures} failures in a row; last good "
                   f"snapshot: {last_good})")

    def _save_now(self) -> str | None:
        """A snapshot of this step, complete on return (end of training, a stop request)."""
        path = self.save()
        return self.finish_pending_save() if path is None and self.pending_step == self.step else path

    def _check_state(self, state: dict) -> None:
        """The trainer's own keys of a snapshot's state, type-checked against this run's objects
        (a snapshot that fails is treated as corrupt: the resume falls back to the previous one)."""
        def count(key):
            return type(state.get(key)) is int and state[key] >= 0

        if not (count("epoch") and count("sample_index")
                and _same_shape(state.get("scheduler"), self.scheduler.state_dict())
                and _same_shape(state.get("scaler"), self.scaler.state_dict())
                and isinstance(state.get("config", {}), dict)):
            raise checkpoint.SnapshotCorruptError(
                f"snapshot step {state.get('step')}: state.json lacks or mistypes the trainer's keys "
                "(epoch, sample_index, scheduler, scaler)")

    def _stored_name(self):
        """Pipeline ranks hold stages in a ModuleList of parts ("<part>.<name>"): the snapshot
        stores the plain model's names, so it does not record how the model was cut."""
        if not self.parallel_model.pipelined:
            return lambda key: key
        return lambda key: key.split(".", 1)[1]

    # ---- the step ------------------------------------------------------------------------------

    def _phase(self, name: str, step: int, micro: int = 0) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(name, step, micro, slow=self.first_step)

    def _timed_batch(self, step: int, micro: int, indices: torch.Tensor, scored: list | None = None):
        self._phase("data", step, micro)
        started = time.perf_counter()
        batch = self._batch(self.data.train, indices, scored)
        self.timing["data"] += time.perf_counter() - started
        return batch

    def _counts_tokens(self) -> bool:
        return self.config.data.task in ("chat", "preference")

    def _batch(self, dataset, indices: torch.Tensor, scored: list | None = None,
               first_scored: torch.Tensor | None = None):
        """(inputs, targets) on the device; packed chat rows' inputs are (ids, example numbers).
        `scored` (a list) gets the number of tokens the loss scores, counted on the host before the
        copy: counting on a GPU would wait there for the step in flight. `first_scored`: evaluation
        windows' first scored position (triax.eval.windows). Under context parallelism the ids and
        targets are this rank's part of each sequence (the example numbers stay whole: attention
        looks them up for the keys of the whole sequence)."""
        x, y = dataset.batch(indices)
        if first_scored is not None:
            y = mask_unscored(y, first_scored)
        x, y = (local_chunks(t, self.cp_rank, self.layout.cp) for t in (x, y))
        if scored is not None:
            scored.append(int((y != IGNORE_INDEX).sum()))
        if dataset is self.data.train and self._counts_tokens():
            self.counted[0] += x.numel()
            self.counted[1] += scored[-1] if scored else int((y != IGNORE_INDEX).sum())
        if getattr(dataset, "packing", False):
            return (self._to_device(x), self._to_device(dataset.document_ids(indices))), self._to_device(y)
        return self._to_device(x), self._to_device(y)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor.to(self.device)
        # From page-locked memory the copy is queued behind the step in flight instead of waiting for
        # it, so the host goes on to launch the next step's kernels (nanoGPT's get_batch does the same).
        return tensor.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def _forward(model, x):
        if isinstance(x, tuple):  # packed rows: attention and positions confined to each example
            ids, documents = x
            return model(ids, documents=documents)
        return model(x)

    def _loss(self, model, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.dpo is not None:  # preference pairs: the mean DPO loss of the batch's pairs
            return self.dpo.loss(self, model, x, y)
        with self.precision.autocast(self.device):
            logits = self._forward(model, x)
        return self._token_loss(logits, y, reduction)

    def _per_token_scale(self, scored: list[int]) -> float | None:
        """Chat data scores a varying number of tokens per row (the answers): each step's loss is
        then the mean over every scored token of the step, on all ranks and micro-batches together,
        not a mean of per-batch means, so every layout and grad_accum computes the same gradient.
        `scored`: the tokens each of this rank's micro-batches scores (counted on the host).
        Returns the factor that turns this rank's summed token losses into its share of that mean
        (data parallelism averages the ranks' gradients); None for data that scores every token,
        and under a pipeline schedule (its loss is a mean per micro-batch, computed on the last stage)."""
        if not self._scores_per_token():
            return None
        # Tensor and pipeline peers hold the same tokens: the world's sum counts each world/reducing times.
        reducing = self.layout.reducing
        total = sum(values[0] for values in gather_floats([float(sum(scored))])) * reducing / self.world_size
        return reducing / max(total, 1.0)

    def _scores_per_token(self) -> bool:
        """Context-parallel ranks hold different tokens of a row: their loss is always the mean over
        every token of the step, so that it equals one process's mean however the targets fall."""
        return (self.config.data.task == "chat" or self.layout.cp > 1) and not self.parallel_model.pipelined

    def _pipeline_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self._pipeline_reduction == "sum":  # evaluation: no backward, no scaling
            return self._token_loss(logits, y, reduction="sum")
        # The schedule runs backward on what this returns: scale it here for fp16.
        return self.scaler.scale(self._token_loss(logits, y))

    def _loss_context(self):
        """Tensor parallelism leaves the logits vocabulary-sharded: the loss and its backward then
        run under loss_parallel, which computes the softmax without gathering the vocabulary."""
        if self.parallel_model.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _pipeline_forward(self, x: torch.Tensor, y: torch.Tensor, train: bool,
                          reduction: str = "mean") -> torch.Tensor:
        """Run the pipeline schedule on one batch (forward and, if `train`, backward); returns the
        mean micro-batch loss (reduction="sum", evaluation only: the summed loss of every target),
        on every rank (the last stage broadcasts it down the pipeline)."""
        pm = self.parallel_model
        losses: list[torch.Tensor] = []
        inputs = (x,) if pm.is_first_stage else ()
        target = y if pm.is_last_stage else None
        self._pipeline_reduction = reduction
        try:
            with self.precision.autocast(self.device):
                if train:
                    pm.schedule.step(*inputs, target=target, losses=losses)
                else:
                    pm.schedule.eval(*inputs, target=target, losses=losses)
        finally:
            self._pipeline_reduction = "mean"
        if pm.is_last_stage and reduction == "sum":
            loss = torch.stack([item.detach().double() for item in losses]).sum()
        elif pm.is_last_stage:
            loss = torch.stack([item.detach().float() for item in losses]).mean()
            if self.scaler.is_enabled():
                loss = loss / self.scaler.get_scale()
        else:
            loss = torch.zeros((), device=self.device, dtype=torch.float64 if reduction == "sum" else torch.float32)
        last_rank = dist.get_global_rank(self.pp_group, self.layout.pp - 1)
        dist.broadcast(loss, src=last_rank, group=self.pp_group)
        return loss

    def train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (this rank's mean micro-batch loss, gradient norm)."""
        loss, grad_norm = self._train_step()
        return float(loss), float(grad_norm)

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns this rank's mean micro-batch loss and the gradient norm as
        tensors on the device, not yet read: reading them waits for the GPU, and the loop reads
        them only on the steps it logs, so the host launches the next step while the GPU works."""
        trainer = self.config.trainer
        if not self.sampler.fits(self.sample_index, self.samples_per_step):
            self.epoch += 1
            self.sample_index = 0
        loss_sum = 0.0
        consumed = []
        step = self.step + 1
        if self.parallel_model.pipelined:
            indices = self.sampler.rank_slice(self.epoch, self.sample_index, trainer.batch_size, self.dp_rank)
            if self.sample_log is not None:
                consumed += indices.tolist()
            batch = self._timed_batch(step, 0, indices)
            self._phase("pipeline schedule", step)
            loss_sum = self._pipeline_forward(*batch, train=True)
        batches, scored = [], [] if self._scores_per_token() else None
        for micro in range(0 if self.parallel_model.pipelined else trainer.grad_accum):
            start = self.sample_index + micro * self.global_micro_batch
            indices = self.sampler.rank_slice(self.epoch, start, trainer.batch_size, self.dp_rank)
            if self.sample_log is not None:
                consumed += indices.tolist()
            batches.append(self._timed_batch(step, micro, indices, scored))
        per_token = self._per_token_scale(scored)
        for micro, (x, y) in enumerate(batches):
            last = micro == trainer.grad_accum - 1
            # Gradients are synchronised only on the last micro-batch; the others accumulate locally.
            with self._sync_context(last), self._loss_context():
                self._phase("forward", step, micro)
                started = time.perf_counter()
                if per_token is None:
                    loss = self._loss(self.model, x, y)
                    scaled = loss / trainer.grad_accum
                else:
                    loss = scaled = self._loss(self.model, x, y, reduction="sum") * per_token
                # A mixture of experts' router losses, of this micro-batch's forward.
                self._router_term = router_metrics.objective_term(self.model, self.config.model)
                if self._router_term is not None:
                    scaled = scaled + self._router_term / trainer.grad_accum
                self.timing["forward"] += time.perf_counter() - started
                self._phase("backward", step, micro)
                self.scaler.scale(scaled).backward()
            loss_sum = loss_sum + loss.detach()
        if per_token is not None:  # loss_sum is already this rank's share of the step's token mean
            loss_sum = loss_sum * trainer.grad_accum
        self._phase("optimizer", step)
        self.scaler.unscale_(self.optimizer)
        max_norm = trainer.grad_clip if trainer.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(list(self.model.parameters()), max_norm, self.pp_group)
        self.scaler.step(self.optimizer)
        router_metrics.after_step(self.model, self.config.model)  # DeepSeek-V3's bias update, if on
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.sample_index += self.samples_per_step
        if self.sample_log is not None:
            self.sample_log.record(self.step, self.epoch, consumed)
        return loss_sum / trainer.grad_accum, grad_norm

    def _sync_context(self, last: bool):
        return contextlib.nullcontext() if last else no_sync(self.model)

    # ---- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss per target token over the windows `trainer.eval_batches` asks for
        (triax.eval.windows: non-overlapping, spread over the whole split; 0 = all of it), each
        token counted once. Data-parallel ranks share the windows and their summed losses and
        token counts are added up exactly, so every layout and process count reports the same
        number. `val_tokens` is how many tokens were scored."""
        if self.dpo is not None:
            return self.dpo.evaluate(self)
        trainer = self.config.trainer
        self.model.eval()
        val = self.data.val
        limit = trainer.eval_batches * self.global_micro_batch if trainer.eval_batches else None
        plan = evaluation_windows(val, limit)
        loss_sum, scored = 0.0, 0
        for starts, first_scored in rank_batches(plan, trainer.batch_size, self.dp_rank, self.layout.dp):
            x, y = self._batch(val, starts, first_scored=first_scored)
            scored += int((y != IGNORE_INDEX).sum())
            if self.parallel_model.pipelined:
                loss_sum += self._pipeline_forward(x, y, train=False, reduction="sum").item()
                continue
            with self._loss_context():
                with self.precision.autocast(self.device):
                    logits = self._forward(self.raw_model, x)
                loss_sum += self._token_loss(logits, y, reduction="sum").item()
        # Tensor- and pipeline-parallel peers hold the same sums: they scale both totals alike.
        totals = [sum(column) for column in zip(*gather_floats([loss_sum, float(scored)]))]
        result = {"val_loss": totals[0] / max(totals[1], 1.0),
                  "val_tokens": round(totals[1] * self.layout.reducing / self.world_size)}
        if self.config.data.task == "addition" and self._can_generate():
            result["val_accuracy"] = addition_accuracy(self.raw_model, val, self.device,
                                                       use_cache=self._generation_cache())
        self.model.train()
        return result

    @torch.no_grad()
    def sample_text(self, prompt: str | None = None) -> str | None:
        vocab = self.data.vocab
        if vocab is None or self.config.trainer.sample_tokens <= 0 or not self._can_generate():
            return None
        first_window = self.data.val.batch(torch.zeros(1, dtype=torch.long))[0][0]
        prompt = prompt or vocab.decode(first_window[: min(16, self.data.block_size)].tolist())
        idx = torch.tensor([vocab.encode(prompt)], device=self.device)
        # The same generator seed on every rank: all ranks draw the same text (needed once the
        # model is sharded and every rank must take part in each forward).
        generator = torch.Generator(device=self.device).manual_seed(self.config.trainer.seed)
        self.raw_model.eval()
        with self.precision.autocast(self.device):
            out = self.raw_model.generate(idx, self.config.trainer.sample_tokens, temperature=0.8,
                                          top_k=20, generator=generator, vocab_limit=len(vocab),
                                          use_cache=self._generation_cache())
        self.raw_model.train()
        return vocab.decode(out[0].tolist())

    def _can_generate(self) -> bool:
        """Token-by-token generation needs the whole model and full logits on one rank: not
        available with pipeline stages, vocabulary-sharded logits or a sequence cut over ranks
        (`triax generate` after the run is)."""
        return not self.parallel_model.pipelined and not self.parallel_model.loss_parallel and self.layout.cp == 1

    def _generation_cache(self) -> bool:
        """Generation keeps earlier tokens' keys and values (GPT.generate's use_cache), except with
        compiled blocks, which would recompile for every new length. (Tensor-parallel runs do not
        generate: see _can_generate.)"""
        return not self.config.parallel.compile

    # ---- the loop ------------------------------------------------------------------------------

    def _throughput(self, steps: int, seconds: float) -> dict:
        """tokens_per_s: the positions the model computed, padding included (what MFU counts);
        chat and preference data (rows of varying length) add loss_tokens: the targets the loss saw
        in the interval, all ranks together, and loss_tokens_per_s (docs/preference.md)."""
        tokens, counted = steps * self.samples_per_step * self.data.block_size, {}
        if self._counts_tokens():  # counted as read; tensor and pipeline peers read the same tokens
            totals = [sum(column) * self.layout.reducing / self.world_size
                      for column in zip(*gather_floats(self.counted))]
            self.counted = [0, 0]
            tokens = totals[0]
            self.pace.tokens_per_step = tokens / max(steps, 1)  # the bar's figure: this interval's rows
            counted = {"loss_tokens": round(totals[1]), "loss_tokens_per_s": round(totals[1] / max(seconds, 1e-9), 1)}
        tokens_per_s = tokens / max(seconds, 1e-9)
        figures = {"tokens_per_s": round(tokens_per_s, 1), **counted, "step_time_s": round(seconds / max(steps, 1), 5)}
        if self._peak_flops is None:  # a CPU or an unknown GPU, no trainer.peak_flops: tokens/s alone
            return figures
        peak, source = self._peak_flops
        mfu = self.flops_per_token * tokens_per_s / (peak * self.world_size)
        if mfu > 1:  # more than the peak: the stated peak is wrong, and the figure would be no utilisation
            if not self._mfu_warned:
                self._mfu_warned = True
                self._warn(f"{100 * mfu:.0f}% of the peak FLOP/s ({peak:.3g}, {source}) would be reported as "
                           "MFU: that peak is too low for this device, so MFU is left out (set trainer.peak_flops)")
            return figures
        return {**figures, "mfu": round(mfu, 5), "peak_flops_source": source}

    def fit(self) -> dict:
        trainer = self.config.trainer
        if self.step >= self.total_steps and self.last_snapshot is not None:  # resumed a finished run: say so
            try:
                self.logger.print(self._complete_message())
            finally:
                self._close_run()
            with raise_together("closing the metrics files"):
                self.logger.close()
            return {}
        if self.is_main:
            params = self.num_params
            # What was loaded, not the preset's name: model.init_from replaced the preset's shape; a
            # preset whose shape keys were changed is named with the changes (model.arch=llama...).
            changes = ", ".join(f"model.{key}={value}" for key, value in self.changed_shape.items())
            loaded = (f"from {self.config.model.init_from}" if self.config.model.init_from else
                      f"{self.config.model.name} with {changes}" if changes else self.config.model.name)
            # The architecture too: a preset's shape can be built as any of them (model.arch).
            threads = f" with {self.threads.describe()}" if self.threads is not None else ""
            processes = f"{self.world_size} process{'es' if self.world_size != 1 else ''}"
            self.logger.print(
                f"training {loaded} ({self.model_config.arch}, {params / 1e6:.2f}M params) on {self.device} x "
                f"{processes} ({self.layout.describe()}){threads}, precision {self.precision.name}, "
                f"{step_count(self.total_steps)} of {self.samples_per_step} samples "
                f"({step_count(self.steps_per_epoch)}/epoch), run dir {trainer.run_dir}")
            if self.config.model.lora.rank:
                lora = self.config.model.lora
                self.logger.print(f"LoRA rank {lora.rank} on {', '.join(lora.targets)}: the base is frozen, "
                                  f"{self.trainable_params / 1e6:.3f}M adapter parameters train")
            if self.data.report:
                self.logger.print(self.data.report)
            if self.batch_note:
                self.logger.print(self.batch_note)
        self.model.train()
        self.logger.start_progress(self.total_steps, self.step)
        self.pace = Pace(self.samples_per_step * self.data.block_size, self.total_steps, self.step)
        self.best_val: tuple[float, int] | None = self.continued_best
        debug = self.config.debug
        stop = StopRequest(self.rank, debug.preempt_at_step, debug.preempt_rank, trainer.stop_grace,
                           self._restart_point).install()
        # `triax train | head -3`: the closed pipe ends the run as Ctrl-C does (triax.tracking.throughput).
        self.logger.on_output_closed = lambda: stop.request("a closed output", "its output was closed "
                                                            "(the reader of the pipe ended)")
        if self.logger.output_closed:
            self.logger.on_output_closed()
        try:
            last = self._loop(stop)
            stop.reached()  # at a step boundary: the final snapshot is not cut short
            self._finish()
            if self.stop_reason is None:
                self.logger.print(self._summary())
        finally:
            stop.uninstall()
            self._close_run()
        with raise_together("closing the metrics files"):  # rank 0's files; the others wait at exit
            self.logger.close()
        return last

    def _close_run(self) -> None:
        """The job is over: the sample log and the watchdog stop, and the run directory is free
        (no lock file stays behind)."""
        if self.sample_log is not None:
            self.sample_log.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.is_main:
            unlock_run_dir(self.config.trainer.run_dir, remove=True)

    def _complete_message(self) -> str:
        """What a resumed run that has nothing left to train says: which limit it reached, and the
        two ways on (train further in this run, or start another one)."""
        trainer = self.config.trainer
        limit = (f"trainer.max_steps={trainer.max_steps}" if trainer.max_steps == self.total_steps
                 else f"trainer.max_epochs={trainer.max_epochs}, {self.steps_per_epoch} steps each")
        further = "trainer.max_steps" if limit.startswith("trainer.max_steps") else "trainer.max_epochs"
        return (f"{trainer.run_dir} is already complete: its snapshot {self.last_snapshot} is at step {self.step} "
                f"and this run ends at step {self.total_steps} ({limit}), so nothing was trained; to train on, "
                f"raise {further}; to start a new run, give another trainer.run_dir")

    def _finish(self) -> None:
        if self.stop_reason is not None:
            path = self._save_now()
            if path is None:
                raise checkpoint.SnapshotWriteError(
                    f"stopped by {self.stop_reason} after step {self.step} but its snapshot could not be written; "
                    f"a restart resumes from {self.last_snapshot or 'the beginning'}")
            self.logger.print(f"stopped by {self.stop_reason} after step {self.step}/{self.total_steps}; snapshot "
                              f"{path} holds everything needed: start the same command again to resume from it")
        elif self.step == self.total_steps and self._save_now() is None:
            raise checkpoint.SnapshotWriteError(f"training finished but the final snapshot could not be written to "
                                                f"{self.snapshot_root}; last good snapshot: {self.last_snapshot}")

    def _loop(self, stop: StopRequest) -> dict:
        trainer = self.config.trainer
        last = {}
        pace = self.pace
        bar_loss = "-"  # the last loss read back (every step on a CPU, logged steps on a GPU)
        while self.step < self.total_steps:
            step_started = time.perf_counter()
            loss, grad_norm = self._train_step()
            logged = self.step % trainer.log_every == 0 or self.step == self.total_steps
            # Reading a value back from a GPU waits for its kernels: a CUDA run reads the loss only on
            # the steps it logs, so the host queues the next step while the GPU runs this one (and the
            # interval's time, taken after the read, is the GPU's). On a CPU the value is there already.
            if logged or self.device.type != "cuda":
                loss, grad_norm = float(loss), float(grad_norm)
                bar_loss = f"{loss:.4f}"
            self.timing["step"] += time.perf_counter() - step_started
            pace.update(self.step)
            # The bar shows the figures the log line shows (one Pace): tokens/s of this log
            # interval so far, and the time left at this session's pace.
            bar = {"loss": bar_loss, "speed": Pace.rate(pace.tokens_per_s)}
            if self.step < self.total_steps:
                bar["left"] = pace.time_left
            self.logger.advance(1, **bar)
            record = None
            if logged:
                self._phase("metrics all-gather", self.step)
                record = {"loss": round(mean_across_ranks(loss), 6),
                          **(self.dpo.take_metrics() if self.dpo is not None else {}),
                          "lr": self.scheduler.get_last_lr()[0], "grad_norm": round(grad_norm, 5),
                          "epoch": self.epoch, **self._throughput(pace.interval_steps, pace.interval_seconds),
                          "peak_mem_mb": round(peak_memory_mb(self.device), 1),
                          **self._rank_times(pace.interval_steps)}
                routing, warning = router_metrics.record(self.model, self._router_term)
                record.update(routing)
                if warning and self.place.is_main:
                    print(warning, file=sys.stderr, flush=True)
            if trainer.eval_every and (self.step % trainer.eval_every == 0 or self.step == self.total_steps):
                self._phase("evaluation", self.step)
                record = {**(record or {}), **self.evaluate()}
                if self.best_val is None or record["val_loss"] < self.best_val[0]:
                    self.best_val = (record["val_loss"], self.step)
                sample = self.sample_text()
                if sample is not None:
                    self.logger.print(f"--- sample at step {self.step} ---\n{sample}\n---")
                elif (not self._can_generate() and not self._said_why_no_sample and self.data.vocab is not None
                      and self.config.trainer.sample_tokens > 0):
                    self._said_why_no_sample = True  # once a run: every evaluation would repeat it
                    self.logger.print(f"no text sample during this run: generating token by token needs the whole model "
                                      f"and all its logits on one rank, which this layout ({self.layout.describe()}) "
                                      f"splits; `triax generate {self.config.trainer.run_dir}` samples from it afterwards")
            if record is not None:
                with raise_together(f"writing the metrics of step {self.step}"):  # rank 0 writes, all agree
                    self.logger.log(self.step, record, console=self._console_line(record))
                last = record
                pace.new_interval()
            epoch_ended = not self.sampler.fits(self.sample_index, self.samples_per_step)
            if ((self.save_every and self.step % self.save_every == 0)
                    or (trainer.save_on_epoch_end and epoch_ended)):
                self.save()
            stop.after_step(self.step)
            # One tiny all-reduce per step: a signal may reach one rank only, or ranks at different
            # steps; agreeing here makes every rank stop after the same step.
            self._phase("stop-agreement all-reduce", self.step)
            self.first_step = False
            if any_rank(stop.requested):
                stop.reached()
                self.stop_reason = stop.reason or "a signal on another rank"
                break
        return last

    def _summary(self) -> str:
        """The end of a run: how long, how fast, how good, and where its files are."""
        pace = self.pace
        pace.update(self.step)
        tokens = pace.session_steps * pace.tokens_per_step
        parts = [f"done: {step_count(pace.session_steps)} in {duration(pace.seconds)} "
                 f"({tokens / max(pace.seconds, 1e-9):,.0f} tokens/s)"]
        if self.best_val is not None:
            parts.append(f"best val_loss {self.best_val[0]:.4f} (step {self.best_val[1]})")
        if self.last_snapshot is not None:
            parts.append(f"snapshot {self.last_snapshot}")
        files = [os.path.join(self.config.trainer.run_dir, name) for name, tracker in
                 (("metrics.jsonl", "jsonl"), ("tensorboard", "tensorboard")) if tracker in self.config.trainer.loggers]
        if files:
            parts.append("logs " + ", ".join(files))
        return "; ".join(parts)

    def _restart_point(self) -> str:
        """Where a restart would begin now, for a stop without a snapshot of this step."""
        if self.last_snapshot is None:
            return f"stopped in step {self.step + 1} with no snapshot yet: a restart begins at step 0"
        return (f"stopped in step {self.step + 1} without a snapshot of it: a restart resumes from "
                f"{self.last_snapshot} (step {self.saved_step})")

    def _rank_times(self, steps: int) -> dict:
        """Every rank's seconds per step in this log interval (a collective), and a warning when one
        rank is persistently slower than the others."""
        per_rank = gather_floats([self.timing[key] / max(steps, 1) for key in ("step", "data", "forward")])
        self.timing = dict.fromkeys(self.timing, 0.0)
        step_s, data_s, forward_s = ([round(values[i], 5) for values in per_rank] for i in range(3))
        hosts = self.watchdog.hosts() if self.watchdog is not None else {}
        for warning in self.stragglers.update(data_s, forward_s, hosts):
            self._warn(warning)
        return {"rank_step_time_s": step_s, "rank_data_time_s": data_s, "rank_forward_time_s": forward_s}

    def _console_line(self, record: dict) -> str:
        parts = [f"step {self.step}/{self.total_steps}"]
        if "loss" in record:
            parts += [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
                      Pace.rate(self.pace.tokens_per_s)]  # the figure the bar shows (record's, unrounded)
            if "mfu" in record:
                parts.append(f"mfu {100 * record['mfu']:.2f}%")
            parts.append(f"mem {record['peak_mem_mb']:.0f}MB")
        if "val_loss" in record:
            parts.append(f"val_loss {record['val_loss']:.4f} ({record['val_tokens']} tokens)")
        if "val_accuracy" in record:
            parts.append(f"val_acc {100 * record['val_accuracy']:.1f}%")
        if "val_rewards/accuracies" in record:  # DPO: the share of validation pairs ranked right
            parts.append(f"val_reward_acc {100 * record['val_rewards/accuracies']:.1f}%")
        if self.step < self.total_steps:
            parts.append(f"{self.pace.time_left} left")
        return " | ".join(parts)


def _same_shape(saved, current) -> bool:
    """Whether JSON `saved` has the keys and value types of `current` (a state_dict of ours)."""
    if isinstance(current, dict):
        return (isinstance(saved, dict) and set(saved) == {str(key) for key in current}
                and all(_same_shape(saved[str(key)], value) for key, value in current.items()))
    if isinstance(current, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_same_shape, saved, current))
    if isinstance(current, bool) or current is None:
        return type(saved) is type(current)
    if isinstance(current, (int, float)):
        return type(saved) in (int, float)
    return isinstance(saved, type(current))


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'key: old -> new' for every config value that differs (for the resume message)."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += _changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append(f"{prefix}{key}: {a} -> {b}")
    return changed


def _remove_new_entries(directory: str, existing: set[str]) -> None:
    """Delete what appeared in `directory` besides `existing` (files, links unfollowed, directories)."""
    for name in set(os.listdir(directory)) - existing:
        path = os.path.join(directory, name)
        if safe_files.is_directory(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            safe_files.remove_file(path)


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
