"""The trainer behind `triax train`: a thin door over the core (runtime, precision, data,
parallel, checkpoint, metrics).

Each step takes the next global batch in the data order (see triax.data.sampler), runs
`grad_accum` micro-batches with gradient sync only on the last, then clips, steps and schedules.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from triax import checkpoint
from triax.data import GlobalSampler
from triax.data.addition import IGNORE_INDEX, addition_accuracy
from triax.errors import ConfigError
from triax.metrics import MetricsLogger, peak_flops, peak_memory_mb
from triax.models import GPT, GPTConfig
from triax.optim import make_adamw, make_schedule
from triax.parallel.ddp import unwrap
from triax.parallel.grad_clip import clip_grad_norm
from triax.parallel.mesh import build_mesh, padded_vocab_size, resolve_layout, validate_layout
from triax.parallel.parallelize import parallelize
from triax.precision import Precision
from triax.runtime import (any_rank, barrier, detect_place, init_distributed, mean_across_ranks, pick_device,
                           seed_everything)
from triax.train.config import TrainConfig, to_dict
from triax.train.data import build_data
from triax.train.preemption import StopRequest

# Test/debug hook: when set, each rank appends "<step> <epoch> <sample ids...>" per optimizer step
# to "<value>.rank<N>", so a test can check which samples a (resumed) run consumed.
SAMPLE_LOG_ENV = "TRIAX_SAMPLE_LOG"


def check_writable_directory(path: str, key: str) -> bool:
    """Create `path` if needed and prove we can write there. Returns whether we created it (so a
    failed start can remove it again and leave nothing behind)."""
    existed = os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_probe_{os.getpid()}")
        with open(probe, "w") as handle:
            handle.write("ok")
        os.remove(probe)
    except OSError as error:
        raise ConfigError(f"{key} {path!r} is not writable ({error.strerror}); "
                          "choose a directory you can write to") from None
    return not existed


class Trainer:
    def __init__(self, config: TrainConfig):
        self.config = config
        trainer = config.trainer
        # Everything that can be wrong with the input is checked before the process group
        # exists, so a mistake is one message per rank, never a hang in a collective.
        self.place = detect_place()
        self.device = pick_device(trainer.device, self.place.local_rank)
        self.precision = Precision(trainer.precision)
        self.precision.check_device(self.device)
        self.data = build_data(config.data)
        parallel = config.parallel
        self.layout = resolve_layout(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp,
                                     self.place.world_size)
        validate_layout(self.layout, n_layer=config.model.n_layer, n_head=config.model.n_head,
                        block_size=self.data.block_size, batch_size=trainer.batch_size,
                        grad_accum=trainer.grad_accum, pp_schedule=parallel.pp_schedule,
                        pp_microbatches=parallel.pp_microbatches, pp_balance=list(parallel.pp_balance),
                        activation_checkpointing=parallel.activation_checkpointing,
                        tie_embeddings=config.model.tie_embeddings, cpu_offload=parallel.cpu_offload)
        padded_rows = padded_vocab_size(self.data.vocab_size, self.layout.tp, self._saved_vocab_rows())
        model_config = GPTConfig(
            vocab_size=self.data.vocab_size,
            padded_vocab_size=padded_rows if padded_rows != self.data.vocab_size else None,
            block_size=self.data.block_size,
            n_layer=config.model.n_layer, n_head=config.model.n_head, n_embd=config.model.n_embd,
            dropout=config.model.dropout, bias=config.model.bias,
            tie_embeddings=config.model.tie_embeddings)
        # Tensor- and pipeline-parallel peers read the same samples: only data parallelism widens the batch.
        self.global_micro_batch = trainer.batch_size * self.layout.dp
        self.samples_per_step = self.global_micro_batch * trainer.grad_accum
        self.steps_per_epoch = len(self.data.train) // self.samples_per_step
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"one step needs {self.samples_per_step} samples (batch_size {trainer.batch_size} x "
                f"{self.layout.dp} data-parallel ranks x grad_accum {trainer.grad_accum}) but the training "
                f"set has {len(self.data.train)}; lower trainer.batch_size or grad_accum")
        created_run_dir = check_writable_directory(trainer.run_dir, "trainer.run_dir")
        self.snapshot_root = trainer.snapshot_dir or os.path.join(trainer.run_dir, "snapshots")
        # A restart by torchrun (--max-restarts) continues this job's own snapshots whatever
        # trainer.resume says: with resume=false the first attempt refused or cleared older ones.
        self.restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        self.resume = trainer.resume or self.restarted
        if not self.resume and not trainer.overwrite:
            existing = checkpoint.latest_snapshot(self.snapshot_root)
            if existing is not None:
                raise ConfigError(
                    f"trainer.resume=false but {self.snapshot_root!r} already holds a run (newest snapshot "
                    f"{existing}); resume it (trainer.resume=true), choose another trainer.run_dir, or add "
                    "trainer.overwrite=true to delete its snapshots and start over")
        try:
            self.place = init_distributed(self.device, self.place)
        except Exception:
            if created_run_dir and self.place.is_main:
                _remove_if_empty(trainer.run_dir)
            raise
        self.rank, self.world_size = self.place.rank, self.place.world_size
        self.is_main = self.rank == 0
        self.dp_rank = self.layout.dp_rank(self.rank)

        seed_everything(trainer.seed)
        self.model_config = model_config
        with torch.device("meta"):  # the whole model's shape, for counting; no memory
            described = GPT(model_config)
        self.num_params = described.num_params()
        self.flops_per_token = described.flops_per_token(self.data.block_size)
        self.mesh = build_mesh(self.layout, self.device.type)
        # Each rank allocates only its own part of the model; the initial weights depend on the seed
        # alone (not on the layout), so they equal the single-process model's.
        self.parallel_model = parallelize(model_config, self.layout, self.mesh, self.precision, parallel, self.device,
                                          seed=trainer.seed, loss_fn=self._pipeline_loss, rank=self.rank)
        self.model = self.parallel_model.model
        # The plain GPT to call for evaluation and sampling (sharded in place by TP/FSDP); a
        # pipeline rank holds only stages of it and evaluates through the schedule instead.
        self.raw_model = None if self.parallel_model.pipelined else unwrap(self.model)
        self.pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        # A different random stream per rank from here on, so dropout masks differ across ranks.
        seed_everything(trainer.seed + 1000 * self.rank)

        optim = config.optim
        # With parallel.cpu_offload the shards, their gradients and so the optimizer step live on the host.
        optimizer_device = torch.device("cpu") if parallel.cpu_offload else self.device
        self.optimizer = make_adamw(self.raw_model if self.raw_model is not None else self.model,
                                    optim.lr, optim.weight_decay, optim.betas, optimizer_device)
        self.sampler = GlobalSampler(len(self.data.train), seed=trainer.seed)
        self.total_steps = self._total_steps()
        self.scheduler = make_schedule(self.optimizer, self.total_steps, optim.warmup_steps, optim.min_lr)
        self.scaler = self.precision.make_scaler(self.device)

        # The position in training: optimizer steps taken, epoch, and the global sample index
        # within the epoch where the next step starts.
        self.step = 0
        self.epoch = 0
        self.sample_index = 0
        self.save_failures = 0  # consecutive failed snapshot writes
        self.last_snapshot: str | None = None
        self.saved_step: int | None = None  # the step of the newest snapshot this process wrote or loaded
        self.stop_reason: str | None = None  # set when a signal stopped the run early
        self.sample_log = None
        if os.environ.get(SAMPLE_LOG_ENV):
            self.sample_log = open(f"{os.environ[SAMPLE_LOG_ENV]}.rank{self.rank}", "a", buffering=1)
        self.logger = MetricsLogger(trainer.run_dir, enabled=self.is_main, total_steps=self.total_steps)
        self._peak_flops: tuple[float, str] | None = None
        if self.is_main:
            self._write_run_files()
        if self.resume:
            self._maybe_resume()
        elif trainer.overwrite:
            if self.is_main:
                checkpoint.remove_snapshots(self.snapshot_root)
            barrier()

    # ---- set-up helpers ------------------------------------------------------------------------

    def _saved_vocab_rows(self) -> int | None:
        """Embedding rows in the snapshot we will resume from (its vocabulary padding), if any."""
        snapshot = checkpoint.latest_snapshot(os.path.join(self.config.trainer.run_dir, "snapshots"))
        if snapshot is None:
            return None
        from safetensors import safe_open

        with safe_open(os.path.join(snapshot, "model.safetensors"), framework="pt") as handle:
            return handle.get_slice("tok_emb.weight").get_shape()[0] if "tok_emb.weight" in handle.keys() else None

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
        with open(os.path.join(run_dir, "config.yaml"), "w") as handle:
            yaml.safe_dump(to_dict(self.config), handle, sort_keys=False)
        with open(os.path.join(run_dir, "model.json"), "w") as handle:
            json.dump(self.model_config.__dict__, handle, indent=1)
        if self.data.vocab is not None:
            with open(os.path.join(run_dir, "vocab.json"), "w") as handle:
                handle.write(self.data.vocab.to_json())

    def _warn(self, message: str) -> None:
        if self.is_main:
            print(f"triax: warning: {message}", file=sys.stderr, flush=True)

    def _maybe_resume(self) -> None:
        found = checkpoint.load_latest_snapshot(self.snapshot_root, self.model, self.optimizer, report=self._warn,
                                                  **self._state_functions("apply"))
        if found is None:
            if self.restarted:
                self.logger.print(f"restart: no snapshot in {self.snapshot_root} yet, starting from step 0")
            return
        snapshot, state = found
        self.step, self.epoch, self.sample_index = state["step"], state["epoch"], state["sample_index"]
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.saved_step, self.last_snapshot = self.step, snapshot
        saved_world = state.get("world_size", self.world_size)
        layout = f", saved by {saved_world} process(es), now {self.world_size}" if saved_world != self.world_size else ""
        self.logger.print(f"resuming from {snapshot}: step {self.step}/{self.total_steps}, epoch {self.epoch}, "
                          f"global sample {self.sample_index}{layout}")
        changed = _changed_keys(state.get("config", {}), to_dict(self.config))
        if changed:
            self.logger.print("config differs from the snapshot's: " + ", ".join(changed))

    def save(self) -> str | None:
        """Write a snapshot of this step. On a storage fault: report it, keep training, and return
        None (the next interval retries); after trainer.max_save_failures failures in a row, raise."""
        trainer = self.config.trainer
        if self.saved_step == self.step:
            return self.last_snapshot
        state = {"epoch": self.epoch, "sample_index": self.sample_index,
                 "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                 "config": to_dict(self.config)}
        try:
            path = checkpoint.save_snapshot(self.snapshot_root, self.step, self.model, self.optimizer, state,
                                            keep_last=trainer.keep_last, **self._state_functions("gather"))
        except checkpoint.SnapshotWriteError as error:
            self.save_failures += 1
            last_good = self.last_snapshot or "none yet"
            if self.save_failures >= trainer.max_save_failures:
                raise checkpoint.SnapshotWriteError(
                    f"{error}; {self.save_failures} snapshot attempts in a row failed (trainer.max_save_failures="
                    f"{trainer.max_save_failures}), so the run stops rather than train unprotected. Free space or "
                    f"fix permissions at {self.snapshot_root}, then start again; last good snapshot: {last_good}") from None
            self._warn(f"{error}; training goes on and retries at the next save "
                       f"({self.save_failures}/{trainer.max_save_failures} failures in a row; last good "
                       f"snapshot: {last_good})")
            return None
        self.save_failures = 0
        self.saved_step, self.last_snapshot = self.step, path
        return path

    def _state_functions(self, which: str) -> dict:
        """Pipeline ranks hold part of the model: they gather / pick their keys themselves."""
        if not self.parallel_model.pipelined:
            return {}
        from triax.parallel.pipeline_checkpoint import pipeline_state_functions

        coords = self.layout.coordinates(self.rank)
        leader = coords["tp"] == 0 and self.dp_rank == 0
        gather, apply = pipeline_state_functions(self.pp_group, leader)
        return {"gather": gather} if which == "gather" else {"apply": apply}

    # ---- the step ------------------------------------------------------------------------------

    def _batch(self, dataset, indices: torch.Tensor):
        x, y = dataset.batch(indices)
        non_blocking = self.device.type == "cuda"
        return x.to(self.device, non_blocking=non_blocking), y.to(self.device, non_blocking=non_blocking)

    def _loss(self, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast(self.device):
            logits = model(x)
        return self._cross_entropy(logits, y)

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The loss in fp32 whatever the compute dtype: a bf16 softmax over the vocabulary loses digits.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1),
                               ignore_index=IGNORE_INDEX)

    def _pipeline_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The schedule runs backward on what this returns: scale it here for fp16.
        return self.scaler.scale(self._cross_entropy(logits, y))

    def _loss_context(self):
        """Tensor parallelism leaves the logits vocabulary-sharded: the loss and its backward then
        run under loss_parallel, which computes the softmax without gathering the vocabulary."""
        if self.parallel_model.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _pipeline_forward(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> torch.Tensor:
        """Run the pipeline schedule on one batch (forward and, if `train`, backward); returns the
        mean micro-batch loss, on every rank (the last stage broadcasts it down the pipeline)."""
        pm = self.parallel_model
        losses: list[torch.Tensor] = []
        inputs = (x,) if pm.is_first_stage else ()
        target = y if pm.is_last_stage else None
        with self.precision.autocast(self.device):
            if train:
                pm.schedule.step(*inputs, target=target, losses=losses)
            else:
                pm.schedule.eval(*inputs, target=target, losses=losses)
        if pm.is_last_stage:
            loss = torch.stack([item.detach().float() for item in losses]).mean()
            if self.scaler.is_enabled():
                loss = loss / self.scaler.get_scale()
        else:
            loss = torch.zeros((), device=self.device)
        last_rank = dist.get_global_rank(self.pp_group, self.layout.pp - 1)
        dist.broadcast(loss, src=last_rank, group=self.pp_group)
        return loss

    def train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (this rank's mean micro-batch loss, gradient norm)."""
        trainer = self.config.trainer
        if not self.sampler.fits(self.sample_index, self.samples_per_step):
            self.epoch += 1
            self.sample_index = 0
        loss_sum = 0.0
        consumed = []
        if self.parallel_model.pipelined:
            indices = self.sampler.rank_slice(self.epoch, self.sample_index, trainer.batch_size, self.dp_rank)
            if self.sample_log is not None:
                consumed += indices.tolist()
            loss_sum = self._pipeline_forward(*self._batch(self.data.train, indices), train=True)
        for micro in range(0 if self.parallel_model.pipelined else trainer.grad_accum):
            start = self.sample_index + micro * self.global_micro_batch
            indices = self.sampler.rank_slice(self.epoch, start, trainer.batch_size, self.dp_rank)
            if self.sample_log is not None:
                consumed += indices.tolist()
            x, y = self._batch(self.data.train, indices)
            last = micro == trainer.grad_accum - 1
            # Gradients are synchronised only on the last micro-batch; the others accumulate locally.
            with self._sync_context(last), self._loss_context():
                loss = self._loss(self.model, x, y)
                self.scaler.scale(loss / trainer.grad_accum).backward()
            loss_sum = loss_sum + loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = trainer.grad_clip if trainer.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(list(self.model.parameters()), max_norm, self.pp_group)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.sample_index += self.samples_per_step
        if self.sample_log is not None:
            self.sample_log.write(f"{self.step} {self.epoch} {' '.join(map(str, consumed))}\n")
        return float(loss_sum) / trainer.grad_accum, float(grad_norm)

    def _sync_context(self, last: bool):
        if last:
            return contextlib.nullcontext()
        if hasattr(self.model, "no_sync"):  # DDP
            return self.model.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2: skip the reduce-scatter

            @contextlib.contextmanager
            def no_fsdp_sync():
                self.model.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    self.model.set_requires_gradient_sync(True)
            return no_fsdp_sync()
        return contextlib.nullcontext()

    # ---- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss over `eval_batches` batches, averaged over all ranks (each rank takes
        different batches of the held-out set)."""
        trainer = self.config.trainer
        self.model.eval()
        val = self.data.val
        batch = min(trainer.batch_size, len(val))
        losses = []
        for i in range(trainer.eval_batches):
            start = ((i * self.layout.dp + self.dp_rank) * batch) % max(1, len(val) - batch + 1)
            indices = torch.arange(start, start + batch)
            if self.parallel_model.pipelined:
                losses.append(self._pipeline_forward(*self._batch(val, indices), train=False).item())
                continue
            with self._loss_context():
                losses.append(self._loss(self.raw_model, *self._batch(val, indices)).item())
        result = {"val_loss": mean_across_ranks(sum(losses) / len(losses))}
        if self.config.data.task == "addition" and self._can_generate():
            result["val_accuracy"] = addition_accuracy(self.raw_model, val, self.device)
        self.model.train()
        return result

    @torch.no_grad()
    def sample_text(self, prompt: str | None = None) -> str | None:
        vocab = self.data.vocab
        if vocab is None or self.config.trainer.sample_tokens <= 0 or not self._can_generate():
            return None
        prompt = prompt or vocab.decode(self.data.val.ids[: min(16, self.data.block_size)])
        idx = torch.tensor([vocab.encode(prompt)], device=self.device)
        # The same generator seed on every rank: all ranks draw the same text (needed once the
        # model is sharded and every rank must take part in each forward).
        generator = torch.Generator(device=self.device).manual_seed(self.config.trainer.seed)
        self.raw_model.eval()
        with self.precision.autocast(self.device):
            out = self.raw_model.generate(idx, self.config.trainer.sample_tokens, temperature=0.8,
                                          top_k=20, generator=generator, vocab_limit=len(vocab))
        self.raw_model.train()
        return vocab.decode(out[0].tolist())

    def _can_generate(self) -> bool:
        """Token-by-token generation needs the whole model and full logits on one rank: not
        available with pipeline stages or vocabulary-sharded logits (`triax generate` after the run is)."""
        return not self.parallel_model.pipelined and not self.parallel_model.loss_parallel

    # ---- the loop ------------------------------------------------------------------------------

    def _throughput(self, steps: int, seconds: float) -> dict:
        tokens = steps * self.samples_per_step * self.data.block_size
        tokens_per_s = tokens / max(seconds, 1e-9)
        if self._peak_flops is None:
            self._peak_flops = peak_flops(self.device, self.precision.compute_dtype)
        peak, source = self._peak_flops
        mfu = self.flops_per_token * tokens_per_s / (peak * self.world_size)
        return {"tokens_per_s": round(tokens_per_s, 1), "mfu": round(mfu, 5), "peak_flops_source": source,
                "step_time_s": round(seconds / max(steps, 1), 5)}

    def fit(self) -> dict:
        trainer = self.config.trainer
        if self.is_main:
            params = self.num_params
            self.logger.print(
                f"training {self.config.model.name} ({params / 1e6:.2f}M params) on {self.device} x "
                f"{self.world_size} process(es) ({self.layout.describe()}), precision {self.precision.name}, "
                f"{self.total_steps} steps of {self.samples_per_step} samples "
                f"({self.steps_per_epoch} steps/epoch), run dir {trainer.run_dir}")
        self.model.train()
        stop = StopRequest(self.rank).install()
        try:
            last = self._loop(stop)
        finally:
            stop.uninstall()
        if self.stop_reason is not None:
            path = self.save()
            if path is None:
                raise checkpoint.SnapshotWriteError(
                    f"stopped by {self.stop_reason} after step {self.step} but its snapshot could not be written; "
                    f"a restart resumes from {self.last_snapshot or 'the beginning'}")
            self.logger.print(f"stopped by {self.stop_reason} after step {self.step}/{self.total_steps}; snapshot "
                              f"{path} holds everything needed: start the same command again to resume from it")
        elif self.step == self.total_steps and self.save() is None:
            raise checkpoint.SnapshotWriteError(f"training finished but the final snapshot could not be written to "
                                                f"{self.snapshot_root}; last good snapshot: {self.last_snapshot}")
        self.logger.close()
        return last

    def _loop(self, stop: StopRequest) -> dict:
        trainer = self.config.trainer
        last = {}
        interval_start, interval_steps = time.perf_counter(), 0
        while self.step < self.total_steps:
            loss, grad_norm = self.train_step()
            interval_steps += 1
            self.logger.advance(1, loss=f"{loss:.4f}")
            record = None
            if self.step % trainer.log_every == 0 or self.step == self.total_steps:
                elapsed = time.perf_counter() - interval_start
                record = {"loss": round(mean_across_ranks(loss), 6),
                          "lr": self.scheduler.get_last_lr()[0], "grad_norm": round(grad_norm, 5),
                          "epoch": self.epoch, **self._throughput(interval_steps, elapsed),
                          "peak_mem_mb": round(peak_memory_mb(self.device), 1)}
            if trainer.eval_every and (self.step % trainer.eval_every == 0 or self.step == self.total_steps):
                record = {**(record or {}), **self.evaluate()}
                sample = self.sample_text()
                if sample is not None:
                    self.logger.print(f"--- sample at step {self.step} ---\n{sample}\n---")
            if record is not None:
                self.logger.log(self.step, record, console=self._console_line(record))
                last = record
                interval_start, interval_steps = time.perf_counter(), 0
            epoch_ended = not self.sampler.fits(self.sample_index, self.samples_per_step)
            if ((trainer.save_every and self.step % trainer.save_every == 0)
                    or (trainer.save_on_epoch_end and epoch_ended)):
                self.save()
            stop.after_step(self.step)
            # One tiny all-reduce per step: a signal may reach one rank only, or ranks at different
            # steps; agreeing here makes every rank stop after the same step.
            if any_rank(stop.requested):
                self.stop_reason = stop.reason or "a signal on another rank"
                break
        return last

    def _console_line(self, record: dict) -> str:
        parts = [f"step {self.step}/{self.total_steps}"]
        if "loss" in record:
            parts += [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
                      f"{record['tokens_per_s']:.0f} tok/s",
                      f"mfu {100 * record['mfu']:.2f}%{' (measured peak)' if record['peak_flops_source'] == 'measured' else ''}",
                      f"mem {record['peak_mem_mb']:.0f}MB"]
        if "val_loss" in record:
            parts.append(f"val_loss {record['val_loss']:.4f}")
        if "val_accuracy" in record:
            parts.append(f"val_acc {100 * record['val_accuracy']:.1f}%")
        return " | ".join(parts)


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


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
