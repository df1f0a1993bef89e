"""What a training run reports as it goes: throughput (tokens/s, MFU), every rank's step times and
stragglers, the console line of a logged step, and the line a run ends with."""

from __future__ import annotations

import os
from typing import Callable, Iterable

from triax.runtime.shared_decisions import gather_floats
from triax.runtime.stragglers import StragglerCheck
from triax.runtime.watchdog import Watchdog
from triax.runtime.threads import ThreadChoice
from triax.tracking.line_fields import LineField, shown_fields
from triax.tracking.throughput import MetricsLogger, Pace, duration, step_count
from triax.config.schema import TrainConfig
from triax.objectives.registry import objective_for
from triax.train.step import TrainingStep


class Console:
    """The figures and lines of one run. `pace` (a Pace) exists once `start` is called: the bar and
    the log line show the same figures from it."""

    def __init__(self, config: TrainConfig, steps: TrainingStep, total_steps: int, flops_per_token: float,
                 peak_flops: tuple[float, str] | None, watchdog: Watchdog | None, warn: Callable[[str], None]):
        self.config, self.steps, self.total_steps = config, steps, total_steps
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.watchdog, self.warn = watchdog, warn
        self.block_size = steps.data.block_size
        self.stragglers = StragglerCheck()
        self.pace: Pace | None = None
        self._mfu_warned = False
        self.fields: list[LineField] = []  # what the objectives add to the line and the bar (show)
        self.bar_figures: dict[str, str] = {}  # those fields as the last logged step wrote them

    def show(self, fields: Iterable[LineField]) -> None:
        """Add an objective's figures to every step line (and the bar) whose record holds them."""
        self.fields += [field for field in fields if field not in self.fields]

    def announce(self, logger: MetricsLogger, arch: str, num_params: int, trainable_params: int,
                 threads: ThreadChoice | None, steps_per_epoch: int, changed_shape: dict,
                 batch_note: str | None) -> None:
        """The run's first lines: what trains, where, in which layout, for how long."""
        config, steps = self.config, self.steps
        # What was loaded, not the preset's name: model.init_from (or the run trainer.continue_from
        # continues) replaced the preset's shape; a preset whose shape keys were changed is named
        # with the changes (model.arch=llama...).
        changes = ", ".join(f"model.{key}={value}" for key, value in changed_shape.items())
        source = config.model.init_from or config.trainer.continue_from
        loaded = (f"from {source}" if source else
                  f"{config.model.name} with {changes}" if changes else config.model.name)
        # The architecture too: a preset's shape can be built as any of them (model.arch).
        described_threads = f" with {threads.describe()}" if threads is not None else ""
        processes = f"{steps.world_size} process{'es' if steps.world_size != 1 else ''}"
        logger.print(
            f"training {loaded} ({arch}, {num_params / 1e6:.2f}M params) on {steps.device} x "
            f"{processes} ({steps.layout.describe()}){described_threads}, precision {steps.precision.name}, "
            f"{step_count(self.total_steps)} of {steps.samples_per_step} {self._samples()} "
            f"({step_count(steps_per_epoch)}/epoch), run dir {config.trainer.run_dir}")
        if config.model.lora.rank:
            lora = config.model.lora
            logger.print(f"LoRA rank {lora.rank} on {', '.join(lora.targets)}: the base is frozen, "
                         f"{trainable_params / 1e6:.3f}M adapter parameters train")
        if steps.data.report:
            logger.print(steps.data.report)
        if batch_note:
            logger.print(batch_note)

    def _samples(self) -> str:
        """What one sample of a step is: a row, or what the objective's sample is (a pair of rows)."""
        return objective_for(self.config.data.task).sample_unit

    def start(self, step: int) -> Pace:
        self.pace = Pace(self.steps.samples_per_step * self.block_size, self.total_steps, step)
        return self.pace

    def throughput(self, steps: int, seconds: float) -> dict:
        """tokens_per_s: the positions the model computed, padding included (what MFU counts);
        data whose answers alone are scored (rows of varying length) add loss_tokens: the targets the
        loss saw in the interval, all ranks together, and loss_tokens_per_s (docs/preference.md)."""
        step, layout = self.steps, self.steps.layout
        tokens, counted = steps * step.samples_per_step * self.block_size, {}
        if step.counts_tokens():  # counted as read; tensor and pipeline peers read the same tokens
            totals = [sum(column) * layout.reducing / step.world_size
                      for column in zip(*gather_floats(step.counted))]
            step.counted = [0, 0]
            tokens = totals[0]
            self.pace.tokens_per_step = tokens / max(steps, 1)  # the bar's figure: this interval's rows
            counted = {"loss_tokens": round(totals[1]), "loss_tokens_per_s": round(totals[1] / max(seconds, 1e-9), 1)}
        tokens_per_s = tokens / max(seconds, 1e-9)
        figures = {"tokens_per_s": round(tokens_per_s, 1), **counted, "step_time_s": round(seconds / max(steps, 1), 5)}
        if self.peak_flops is None:  # a CPU or an unknown GPU, no trainer.peak_flops: tokens/s alone
            return figures
        peak, source = self.peak_flops
        mfu = self.flops_per_token * tokens_per_s / (peak * step.world_size)
        if mfu > 1:  # more than the peak: the stated peak is wrong, and the figure would be no utilisation
            if not self._mfu_warned:
                self._mfu_warned = True
                self.warn(f"{100 * mfu:.0f}% of the peak FLOP/s ({peak:.3g}, {source}) would be reported as "
                          "MFU: that peak is too low for this device, so MFU is left out (set trainer.peak_flops)")
            return figures
        return {**figures, "mfu": round(mfu, 5), "peak_flops_source": source}

    def rank_times(self, steps: int) -> dict:
        """Every rank's seconds per step in this log interval (a collective), and a warning when one
        rank is persistently slower than the others."""
        timing = self.steps.timing
        per_rank = gather_floats([timing[key] / max(steps, 1) for key in ("step", "data", "forward")])
        self.steps.timing = dict.fromkeys(timing, 0.0)
        step_s, data_s, forward_s = ([round(values[i], 5) for values in per_rank] for i in range(3))
        hosts = self.watchdog.hosts() if self.watchdog is not None else {}
        for warning in self.stragglers.update(data_s, forward_s, hosts):
            self.warn(warning)
        return {"rank_step_time_s": step_s, "rank_data_time_s": data_s, "rank_forward_time_s": forward_s}

    def line(self, record: dict) -> str:
        """The console line of a logged step."""
        step = self.steps.position.step
        parts = [f"step {step}/{self.total_steps}"]
        if "loss" in record:
            shown = shown_fields(self.fields, record)
            self.bar_figures = shown
            parts += [f"loss {record['loss']:.4f}", *(f"{name} {value}" for name, value in shown.items()),
                      f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}",
                      Pace.rate(self.pace.tokens_per_s)]  # the figure the bar shows (record's, unrounded)
            if "mfu" in record:
                parts.append(f"mfu {100 * record['mfu']:.2f}%")
            parts.append(f"mem {record['peak_mem_mb']:.0f}MB")
        if "val_loss" in record:
            # Data whose answers alone are scored: the count says so (and an evaluation of pairs, its pairs).
            scored = "answer tokens" if objective_for(self.config.data.task).scores_answers else "tokens"
            pairs = f"{record['val_pairs']} pairs, " if "val_pairs" in record else ""
            parts.append(f"val_loss {record['val_loss']:.4f} ({pairs}{record['val_tokens']} {scored})")
            parts += [f"{key} {value:.4f}" for key, value in record.items() if key.startswith("val_loss/")]
        if "val_accuracy" in record:
            parts.append(f"val_acc {100 * record['val_accuracy']:.1f}%")
        if "val_rewards/accuracies" in record:  # the share of validation pairs ranked right
            parts.append(f"val_reward_acc {100 * record['val_rewards/accuracies']:.1f}%")
        if "val_pass_rate" in record:  # held-out prompts' completions that every reward passed
            parts.append(f"val_reward {record['val_reward']:.3f} val_pass {100 * record['val_pass_rate']:.1f}%")
        if step < self.total_steps:
            parts.append(f"{self.pace.time_left} left")
        return " | ".join(parts)

    def summary(self, best_val: tuple[float, int] | None, last_snapshot: str | None) -> str:
        """The end of a run: how long, how fast, how good, and where its files are."""
        pace = self.pace
        pace.update(self.steps.position.step)
        tokens = pace.session_steps * pace.tokens_per_step
        parts = [f"done: {step_count(pace.session_steps)} in {duration(pace.seconds)} "
                 f"({tokens / max(pace.seconds, 1e-9):,.0f} tokens/s)"]
        if best_val is not None:
            parts.append(f"best val_loss {best_val[0]:.4f} (step {best_val[1]})")
        if last_snapshot is not None:
            parts.append(f"snapshot {last_snapshot}")
        trainer = self.config.trainer
        files = [os.path.join(trainer.run_dir, name) for name, tracker in
                 (("metrics.jsonl", "jsonl"), ("tensorboard", "tensorboard")) if tracker in trainer.loggers]
        if files:
            parts.append("logs " + ", ".join(files))
        return "; ".join(parts)

    def complete_message(self, last_snapshot: str | None, steps_per_epoch: int) -> str:
        """What a resumed run that has nothing left to train says: which limit it reached, and the
        two ways on (train further in this run, or start another one)."""
        trainer = self.config.trainer
        limit = (f"trainer.max_steps={trainer.max_steps}" if trainer.max_steps == self.total_steps
                 else f"trainer.max_epochs={trainer.max_epochs}, {steps_per_epoch} steps each")
        further = "trainer.max_steps" if limit.startswith("trainer.max_steps") else "trainer.max_epochs"
        return (f"{trainer.run_dir} is already complete: its snapshot {last_snapshot} is at step "
                f"{self.steps.position.step} and this run ends at step {self.total_steps} ({limit}), so nothing "
                f"was trained; to train on, raise {further}; to start a new run, give another trainer.run_dir")
