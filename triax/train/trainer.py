"""The trainer behind `triax train`: a thin door over the core (runtime, precision, data,
parallel, checkpoint, metrics) that conducts its components, each in its own module:

- triax.train.step: one optimizer step (batches, forward, loss, backward, optimizer) and the position
- triax.train.snapshots: saving, storage faults, the resume and the final snapshot
- triax.train.evaluation: the validation loss and text samples
- triax.train.console: throughput, MFU, rank times and the console lines
- triax.runs.directory: trainer.run_dir's lock and files

Each step takes the next global batch in the data order (see triax.data.sampler), runs
`grad_accum` micro-batches with gradient sync only on the last, then clips, steps and schedules.
"""

from __future__ import annotations

import operator
import sys
import time

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from triax import checkpoint
from triax.checkpoint.rng import seed_everything
from triax.data.mixture import sampler_for
from triax.doctor.readiness import preflight
from triax.errors import ConfigError, printable
from triax.models import build_model
from triax.models.config import GPTConfig
from triax.models.lora import apply_lora, trainable_summary
from triax.interop.peft.adapter import load_adapter
from triax.parallel.ddp import unwrap
from triax.parallel.mesh import build_mesh
from triax.parallel.parallelize import parallelize
from triax.runtime.failure_agreement import raise_together
from triax.runtime.shared_decisions import any_rank, mean_across_ranks
from triax.tracking.throughput import Pace, peak_memory_mb, stated_peak_flops
from triax.interop.foreign_run import ForeignRun
from triax.train import continuation, init_from
from triax.config.compose import continuation_overrides
from triax.train.console import Console
from triax.objectives import Objective, RunParts
from triax.objectives.reference import reference_for
from triax.objectives.registry import added_terms, objective_for
from triax.objectives.tokens.loss import loss_function
from triax.train.evaluation import Evaluation
from triax.train.needs import run_needs
from triax.train.optim import make_adamw, make_schedule, move_schedule
from triax.train.preemption import StopRequest
from triax.runs.directory import RunDirectory
from triax.train.sample_log import SampleLog
from triax.config.schema import TrainConfig, asynchronous_snapshots, final_lr, snapshot_every, total_steps
from triax.train.snapshots import Snapshots
from triax.train.prepare import PreparedRun, prepare_run
from triax.train.startup import join_job
from triax.train.step import Optimization, RankPlace, TrainingStep


def _held_by(component: str, name: str, doc: str) -> property:
    """A Trainer attribute that one of its components holds (`component`: a dotted path from the
    Trainer), readable and settable under its old name."""
    holder = operator.attrgetter(component)
    return property(lambda trainer: getattr(holder(trainer), name),
                    lambda trainer, value: setattr(holder(trainer), name, value), doc=doc)


class Trainer:
    """One process's part of a `triax train` job. Every process of the job builds one from the same
    checked config (`compose_config`), prepared before any process group (`prepare_run`: the data,
    the layout and the resolved config); the constructor joins the job, builds this rank's model
    shards, optimizer and metrics, and resumes from the newest good snapshot when
    `trainer.resume` is set. `fit()` then trains to `trainer.max_steps` / `max_epochs`:

        from triax.train import Trainer, compose_config

        Trainer(compose_config(["model=gpt-nano", "trainer.max_steps=100"])).fit()

    The work is done by its components: `steps` (triax.train.step), `snapshots`, `evaluation`,
    `console` and `run_directory`.
    """

    def __init__(self, run: PreparedRun | TrainConfig, continued: ForeignRun | None = None):
        """`run`: what `prepare_run` (triax.train.prepare) resolved before any process group, trained
        as it is. A TrainConfig, the Python API's `Trainer(compose_config([...]))`, is prepared here,
        once (the config itself never edited), with `continued`: trainer.continue_from's run as
        `compose_run` opened it, not opened again."""
        if isinstance(run, TrainConfig):
            # One call for the documented API and the benches, as before; `triax train` prepares
            # first (triax.commands.train), so a PreparedRun is what every path trains.
            run = prepare_run(run, continued)
        elif continued is not None:
            raise ConfigError("Trainer(prepared_run, continued): trainer.continue_from's run is given to "
                              "prepare_run(config, continued), which the prepared run already holds; "
                              "leave `continued` out")
        self._take(run)
        config, model_config = self.config, run.model_config
        self._join_job(run.created_run_dir)
        if config.trainer.preflight:
            # model.init_from's checkpoint as the run opened it, not opened again for the doctor's sizes
            preflight(config, self.place, self.device,
                      lambda checked, world_size, device: run_needs(
                          checked, world_size, self.init_source if checked.model.init_from else None, device))
        self._build_model(model_config)
        self._build_optimizer()
        self.stop_reason: str | None = None  # set when a signal stopped the run early
        self.run_directory = RunDirectory(config, self.is_main)
        self.logger = self.run_directory.open(self, run.created_run_dir, self.model_config, self.data, self.init_source)
        self.console = Console(config, self.steps, self.total_steps, self.flops_per_token,
                               stated_peak_flops(self.device, self.precision.compute_dtype, config.trainer.peak_flops),
                               self.watchdog, self._warn)
        for part in (*self.steps.terms, self.objective):  # the few figures each logs that a person watches
            self.console.show(part.line_fields)
        self.continued_best: tuple[float, int] | None = None  # the best val loss of the run continued
        if self.resume:
            self.snapshots.resume(self.logger, self.total_steps, self.world_size, self.restarted)
        elif config.trainer.overwrite:
            with raise_together(f"deleting the old snapshots in {self.snapshot_root}"):
                if self.is_main:
                    checkpoint.remove_snapshots(self.snapshot_root)
        if config.trainer.continue_from and self.saved_step is None:
            self._continue_run()

    # ---- where training stands: attributes its components hold -------------------------------

    step = _held_by("steps.position", "step", "Optimizer steps taken.")
    epoch = _held_by("steps.position", "epoch", "The epoch the next step draws from.")
    sample_index = _held_by("steps.position", "sample_index",
                            "The global sample index within the epoch where the next step starts.")
    last_snapshot = _held_by("snapshots", "last_snapshot", "The newest snapshot this process wrote or loaded.")
    saved_step = _held_by("snapshots", "saved_step", "The step of last_snapshot.")
    resume_stats = _held_by("snapshots", "resume_stats",
                            "bytes_read: what this rank read of the snapshot it resumed from.")
    async_save = _held_by("snapshots", "asynchronous", "Whether snapshots are written in the background.")

    # ---- the run as prepared, then the job ------------------------------------------------------

    def _take(self, run: PreparedRun) -> None:
        """What prepare_run derived before any process group, under the Trainer's own names."""
        self.config = run.config  # trained as it is: nothing below edits it
        self.place, self.device, self.threads, self.precision = run.place, run.device, run.threads, run.precision
        self.init_source, self.changed_shape, self.data, self.layout = (run.init_source, run.changed_shape,
                                                                        run.data, run.layout)
        self.batch_note, self.global_micro_batch = run.batch_note, run.global_micro_batch
        self.samples_per_step, self.steps_per_epoch = run.samples_per_step, run.steps_per_epoch
        self.snapshot_root, self.restarted, self.resume = run.snapshot_root, run.restarted, run.resume

    def _join_job(self, created_run_dir: bool) -> None:
        """The watchdog and the process group (triax.train.startup), and this rank's coordinates."""
        self.place, self.watchdog = join_job(self.config, self.place, self.device, self, created_run_dir)
        self.rank, self.world_size = self.place.rank, self.place.world_size
        self.is_main = self.rank == 0
        self.dp_rank = self.layout.dp_rank(self.rank)
        self.cp_rank = self.layout.coordinates(self.rank)["cp"]  # which part of each sequence this rank holds

    def _build_model(self, model_config: GPTConfig) -> None:
        """This rank's part of the model, in its layout, from the seed (or model.init_from)."""
        trainer, parallel = self.config.trainer, self.config.parallel
        seed_everything(trainer.seed)
        self.model_config = model_config
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
                         self.config.model.lora.init_from, self.config.model.lora, self._stored_name())
        self.objective = self._objective(model_config)
        self.steps_per_epoch *= self.objective.steps_per_batch  # a produced batch may serve several steps
        self.pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        # A different random stream per rank from here on, so dropout masks differ across ranks.
        seed_everything(trainer.seed + 1000 * self.rank)

    def _objective(self, model_config: GPTConfig) -> Objective:
        """What the step optimises: data.task's objective (triax.objectives.registry), given the
        reference it needs, in the one form the run allows (triax.objectives.reference)."""
        def autocast():  # the run's precision on this device, for what the objective runs itself (sampling)
            return self.precision.autocast(self.device)

        objective = objective_for(self.config.data.task).build(
            RunParts(self.config, self.data, self.raw_model, self.device, autocast, self.layout.dp, self._token_loss))
        if objective.needs_reference():  # after model.lora.init_from's adapters are read, before a resume
            objective.use_reference(reference_for(self.config.model.lora, self.raw_model,
                                                  lambda: self._frozen_reference(model_config)))
        return objective

    def _frozen_reference(self, model_config: GPTConfig) -> torch.nn.Module:
        """The reference without LoRA: a second model from model.init_from, built and sharded as the
        policy (each rank holds its part alone), frozen, never in the optimizer or the snapshots."""
        # Without DDP's wrapper (nothing to synchronise: it has no gradients); FSDP and TP shard in place.
        reference = unwrap(parallelize(model_config, self.layout, self.mesh, self.precision, self.config.parallel,
                                       self.device, seed=self.config.trainer.seed, rank=self.rank).model)
        init_from.load_weights(self.init_source, reference, model_config, self._stored_name())
        for parameter in reference.parameters():
            parameter.requires_grad_(False)
        return reference.eval()

    def _build_optimizer(self) -> None:
        """AdamW over this rank's parameters, the schedule, the loss scaler and the data order; then
        the step and the snapshots, which work on them."""
        config, optim, parallel = self.config, self.config.optim, self.config.parallel
        # With parallel.cpu_offload the shards, their gradients and so the optimizer step live on the host.
        optimizer_device = torch.device("cpu") if parallel.cpu_offload else self.device
        self.optimizer = make_adamw(self.raw_model if self.raw_model is not None else self.model,
                                    optim.lr, optim.weight_decay, optim.betas, optimizer_device,
                                    decay=optim.decay, fused=optim.fused, eps=optim.eps)
        self.sampler = sampler_for(self.data.train, config.trainer.seed, config.data.shuffle)
        self.total_steps = total_steps(config.trainer, self.steps_per_epoch)
        self.scheduler = make_schedule(self.optimizer, optim.decay_steps or self.total_steps, optim.warmup_steps,
                                       final_lr(optim), optim.schedule)
        self.scaler = self.precision.make_scaler(self.device)
        self.save_every = snapshot_every(config.trainer)
        self.sample_log = SampleLog(config.debug.sample_log, self.rank) if config.debug.sample_log else None
        optimization = Optimization(self.optimizer, self.scheduler, self.scaler, self.sampler)
        place = RankPlace(self.layout, self.device, self.world_size, self.dp_rank, self.cp_rank, self.pp_group)
        self.steps = TrainingStep(config, place, self.precision, self.data, self.parallel_model, optimization,
                                  self._token_loss, self.objective, added_terms(self.model_config), self.sample_log,
                                  self.watchdog)
        self.snapshots = Snapshots(config, self.snapshot_root, self.model, self.model_config, optimization,
                                   self.steps.position, self._stored_name(),
                                   asynchronous_snapshots(config.trainer, self.device), self.steps.phase, self._warn)
        self.evaluation = Evaluation(self.steps)

    def _pipeline_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss the pipeline's last stage computes inside the schedule (parallelize is given it
        before the step exists)."""
        return self.steps.pipeline_loss(logits, y)

    def _stored_name(self):
        """Pipeline ranks hold stages in a ModuleList of parts ("<part>.<name>"): the snapshot
        stores the plain model's names, so it does not record how the model was cut."""
        if not self.parallel_model.pipelined:
            return lambda key: key
        return lambda key: key.split(".", 1)[1]

    def _warn(self, message: str) -> None:
        if self.is_main:
            print(f"triax: warning: {printable(message)}", file=sys.stderr, flush=True)

    # ---- set-up helpers ------------------------------------------------------------------------

    def _continue_run(self) -> None:
        """trainer.continue_from: the other tool's AdamW state, step and best val loss, on top of
        the weights init_from loaded; the schedule moves to that step (its settings came with the
        config). A run already at or past its end says so, as a resumed one does."""
        source = self.init_source
        model = self.raw_model if self.raw_model is not None else self.model
        # The notes first, while the checkpoint read for the config is still held: load() lets a
        # Trainer's go, and asking afterwards would read its whole optimizer.pt again.
        _, notes = continuation_overrides(self.config, source)
        get_optimizer_state_dict(model, self.optimizer)  # creates AdamW's state, to be overwritten
        self.step, self.continued_best = continuation.load(source, model, self.optimizer, self.model_config,
                                                           self._stored_name())
        move_schedule(self.scheduler, self.step)
        best = f", best val loss {self.continued_best[0]:.4f}" if self.continued_best is not None else ""
        self.logger.print(f"continuing {source.tool_name} run {source.path} at step {self.step}/"
                          f"{self.total_steps}{best}: its AdamW state and schedule "
                          f"(lr {self.scheduler.get_last_lr()[0]:.3e} next)" + "".join(f"; {note}" for note in notes))

    # ---- the public API: one step, evaluation, samples, snapshots --------------------------------

    def train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (this rank's mean micro-batch loss, gradient norm)."""
        loss, grad_norm = self.steps.run()
        return float(loss), float(grad_norm)

    def evaluate(self) -> dict:
        """The validation loss per target token (triax.train.evaluation)."""
        return self.evaluation.evaluate()

    def sample_text(self, prompt: str | None = None) -> str | None:
        return self.evaluation.sample_text(prompt)

    def save(self) -> str | None:
        """Write a snapshot of this step (triax.train.snapshots: storage faults, trainer.async_save);
        returns its path, or None while it is written in the background or after a reported fault."""
        return self.snapshots.save()

    def finish_pending_save(self) -> str | None:
        """Wait for the snapshot in flight, if any; returns its path, or None if it failed (reported)."""
        return self.snapshots.finish_pending()

    # ---- the loop ------------------------------------------------------------------------------

    def fit(self) -> dict:
        if self.step >= self.total_steps and self.last_snapshot is not None:  # resumed a finished run: say so
            try:
                self.logger.print(self.console.complete_message(self.last_snapshot, self.steps_per_epoch))
            finally:
                self._close_run()
            with raise_together("closing the metrics files"):
                self.logger.close()
            return {}
        if self.is_main:
            self.console.announce(self.logger, self.model_config.arch, self.num_params, self.trainable_params,
                                  self.threads, self.steps_per_epoch, self.changed_shape, self.batch_note)
        self.model.train()
        self.logger.start_progress(self.total_steps, self.step)
        self.console.start(self.step)
        self.best_val: tuple[float, int] | None = self.continued_best
        debug = self.config.debug
        stop = StopRequest(self.rank, debug.preempt_at_step, debug.preempt_rank, self.config.trainer.stop_grace,
                           self.snapshots.restart_point).install()
        # `triax train | head -3`: the closed pipe ends the run as Ctrl-C does (triax.tracking.throughput).
        self.logger.on_output_closed = lambda: stop.request("a closed output", "its output was closed "
                                                            "(the reader of the pipe ended)")
        if self.logger.output_closed:
            self.logger.on_output_closed()
        try:
            last = self._loop(stop)
            stop.reached()  # at a step boundary: the final snapshot is not cut short
            self._check_finite()
            self.snapshots.finish(self.stop_reason, self.logger, self.total_steps)
            if self.stop_reason is None:
                self.logger.print(self.console.summary(self.best_val, self.last_snapshot))
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
        self.run_directory.release()

    def _loop(self, stop: StopRequest) -> dict:
        trainer, steps = self.config.trainer, self.steps
        last = {}
        pace = self.console.pace
        bar_loss = "-"  # the last loss read back (every step on a CPU, logged steps on a GPU)
        while self.step < self.total_steps:
            step_started = time.perf_counter()
            loss, grad_norm = steps.run()
            logged = self.step % trainer.log_every == 0 or self.step == self.total_steps
            # Reading a value back from a GPU waits for its kernels: a CUDA run reads the loss only on
            # the steps it logs, so the host queues the next step while the GPU runs this one (and the
            # interval's time, taken after the read, is the GPU's). On a CPU the value is there already.
            if logged:  # a loss no longer finite stops the run before it is logged or saved
                self._check_finite()
            if logged or self.device.type != "cuda":
                loss, grad_norm = float(loss), float(grad_norm)
                bar_loss = f"{loss:.4f}"
            steps.timing["step"] += time.perf_counter() - step_started
            pace.update(self.step)
            # The bar shows the figures the log line shows (one Pace): tokens/s of this log
            # interval so far, and the time left at this session's pace.
            bar = {"loss": bar_loss, **self.console.bar_figures, "speed": Pace.rate(pace.tokens_per_s)}
            if self.step < self.total_steps:
                bar["left"] = pace.time_left
            self.logger.advance(1, **bar)
            record = self._step_record(loss, grad_norm) if logged else None
            if trainer.eval_every and (self.step % trainer.eval_every == 0 or self.step == self.total_steps):
                record = {**(record or {}), **self._evaluate_and_sample()}
            if record is not None:
                with raise_together(f"writing the metrics of step {self.step}"):  # rank 0 writes, all agree
                    self.logger.log(self.step, record, console=self.console.line(record))
                last = record
                pace.new_interval()
            epoch_ended = not self.sampler.fits(self.sample_index, self.samples_per_step)
            if ((self.save_every and self.step % self.save_every == 0)
                    or (trainer.save_on_epoch_end and epoch_ended)):
                self._check_finite()
                self.save()
            if self._stop_agreed(stop):
                break
        return last

    def _check_finite(self) -> None:
        """Stop (every rank, one line) before a loss or gradient norm that is no longer finite is logged
        or saved: the last finite snapshot stays the newest (triax.train.finite_watch)."""
        self.steps.finite.check(self.last_snapshot, self.saved_step)

    def _stop_agreed(self, stop: StopRequest) -> bool:
        """Whether any rank was asked to stop: then every rank stops after this step."""
        stop.after_step(self.step)
        # One tiny all-reduce per step: a signal may reach one rank only, or ranks at different
        # steps; agreeing here makes every rank stop after the same step.
        self.steps.phase("stop-agreement all-reduce", self.step)
        self.steps.first_step = False
        if any_rank(stop.requested):
            stop.reached()
            self.stop_reason = stop.reason or "a signal on another rank"
            return True
        return False

    def _step_record(self, loss: float, grad_norm: float) -> dict:
        """A logged step's metrics, agreed over the ranks (collectives: every rank computes them)."""
        pace = self.console.pace
        self.steps.phase("metrics all-gather", self.step)
        record = {"loss": round(mean_across_ranks(loss), 6),
                  **self.objective.take_figures(),
                  "lr": self.scheduler.get_last_lr()[0], "grad_norm": round(grad_norm, 5),
                  "epoch": self.epoch, **self.console.throughput(pace.interval_steps, pace.interval_seconds),
                  "peak_mem_mb": round(peak_memory_mb(self.device), 1),
                  **self.console.rank_times(pace.interval_steps)}
        for term in self.steps.terms:  # what the model adds to the objective: its figures, and a warning
            figures, warning = term.record(self.model)
            record.update(figures)
            if warning and self.place.is_main:
                print(warning, file=sys.stderr, flush=True)
        return record

    def _evaluate_and_sample(self) -> dict:
        """The evaluation of this step (the best val loss so far kept), and a text sample (or, once a
        run, why there is none)."""
        self.steps.phase("evaluation", self.step)
        record = self.evaluate()
        if "val_loss" in record and (self.best_val is None or record["val_loss"] < self.best_val[0]):
            self.best_val = (record["val_loss"], self.step)
        line = self.evaluation.sample_line(self.step)
        if line is not None:
            self.logger.print(line)
        return record
