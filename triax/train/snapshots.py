"""The trainer's snapshots: writing one (in the background with trainer.async_save), what a storage
fault does to a run, the resume from the newest good one, and the final snapshot of a run or of a
stop request. The format itself is triax.checkpoint's."""

from __future__ import annotations

from typing import Callable

import torch

from triax import checkpoint
from triax.errors import ConfigError
from triax.models import vocabulary_rows
from triax.models.config import GPTConfig
from triax.runtime.rendezvous import restart_count
from triax.runtime.shared_decisions import any_rank
from triax.tracking.throughput import MetricsLogger
from triax.config.compose import to_dict
from triax.config.schema import TrainConfig, snapshot_root
from triax.train.step import Optimization, Position


class Snapshots:
    """This rank's side of the run's snapshots. `last_snapshot` and `saved_step`: the newest
    snapshot this process wrote or loaded, and its step; `resume_stats` (bytes_read): what this
    rank read of the snapshot it resumed from."""

    def __init__(self, config: TrainConfig, root: str, model: torch.nn.Module, model_config: GPTConfig,
                 optimization: Optimization, position: Position, stored_name: Callable[[str], str],
                 asynchronous: bool, phase: Callable[[str, int], None], warn: Callable[[str], None]):
        self.config, self.root, self.model, self.model_config = config, root, model, model_config
        self.optimization, self.position, self.stored_name = optimization, position, stored_name
        self.asynchronous, self.phase, self.warn = asynchronous, phase, warn
        self.save_failures = 0  # consecutive failed snapshot writes
        self.last_snapshot: str | None = None
        self.saved_step: int | None = None
        self.pending_save: checkpoint.PendingSnapshot | None = None  # trainer.async_save: the write in flight
        self.pending_step: int | None = None
        self.resume_stats: dict = {}

    def save(self) -> str | None:
        """Write a snapshot of this step. On a storage fault: report it, keep training, and return
        None (the next interval retries); after trainer.max_save_failures failures in a row, raise.
        With trainer.async_save the write goes on in the background: this waits for the previous
        one first (at most one in flight) and returns None until `finish_pending` says more."""
        trainer, position, optimization = self.config.trainer, self.position, self.optimization
        if self.saved_step == position.step or self.pending_step == position.step:
            return self.last_snapshot if self.saved_step == position.step else None
        self.finish_pending()
        state = {"epoch": position.epoch, "sample_index": position.sample_index,
                 "scheduler": optimization.scheduler.state_dict(), "scaler": optimization.scaler.state_dict(),
                 "config": to_dict(self.config), "model": dict(self.model_config.__dict__)}
        self.phase("snapshot", position.step)
        try:
            pending = checkpoint.start_snapshot(self.root, position.step, self.model, optimization.optimizer, state,
                                                keep_last=trainer.keep_last, stored_name=self.stored_name,
                                                asynchronous=self.asynchronous)
        except checkpoint.SnapshotWriteError as error:
            self._failed(error)
            return None
        self.pending_save, self.pending_step = pending, position.step
        if self.asynchronous:
            return None
        return self.finish_pending()

    def finish_pending(self) -> str | None:
        """Wait for the snapshot in flight, if any; returns its path, or None if it failed (reported)."""
        if self.pending_save is None:
            return None
        pending, step = self.pending_save, self.pending_step
        self.pending_save = self.pending_step = None
        try:
            path = pending.wait()
        except checkpoint.SnapshotWriteError as error:
            self._failed(error)
            return None
        self.save_failures = 0
        self.saved_step, self.last_snapshot = step, path
        return path

    def _failed(self, error: Exception) -> None:
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
                f"fix permissions at {self.root}, then start again; last good snapshot: {last_good}") from None
        self.warn(f"{error}; training goes on and retries at the next save "
                  f"({self.save_failures}/{trainer.max_save_failures} failures in a row; last good "
                  f"snapshot: {last_good})")

    def save_now(self) -> str | None:
        """A snapshot of this step, complete on return (end of training, a stop request)."""
        path = self.save()
        return self.finish_pending() if path is None and self.pending_step == self.position.step else path

    def finish(self, stop_reason: str | None, logger: MetricsLogger, total_steps: int) -> None:
        """The last snapshot of a run that ended or was stopped; raises if it cannot be written."""
        step = self.position.step
        if stop_reason is not None:
            path = self.save_now()
            if path is None:
                raise checkpoint.SnapshotWriteError(
                    f"stopped by {stop_reason} after step {step} but its snapshot could not be written; "
                    f"a restart resumes from {self.last_snapshot or 'the beginning'}")
            logger.print(f"stopped by {stop_reason} after step {step}/{total_steps}; snapshot "
                         f"{path} holds everything needed: start the same command again to resume from it")
        elif step == total_steps and self.save_now() is None:
            raise checkpoint.SnapshotWriteError(f"training finished but the final snapshot could not be written to "
                                                f"{self.root}; last good snapshot: {self.last_snapshot}")

    def restart_point(self) -> str:
        """Where a restart would begin now, for a stop without a snapshot of this step."""
        step = self.position.step
        if self.last_snapshot is None:
            return f"stopped in step {step + 1} with no snapshot yet: a restart begins at step 0"
        return (f"stopped in step {step + 1} without a snapshot of it: a restart resumes from "
                f"{self.last_snapshot} (step {self.saved_step})")

    # ---- the resume ----------------------------------------------------------------------------

    def resume(self, logger: MetricsLogger, total_steps: int, world_size: int, restarted: bool) -> None:
        """Load the newest good snapshot, if any: the weights, AdamW, the schedule, the scaler and
        the position in the data."""
        found = checkpoint.load_latest_snapshot(self.root, self.model, self.optimization.optimizer, report=self.warn,
                                                stored_name=self.stored_name, check_state=self.check_state,
                                                stats=self.resume_stats, real_rows=vocabulary_rows(self.model_config))
        if found is None:
            if restarted:
                logger.print(f"restart: no snapshot in {self.root} yet, starting from step 0")
            return
        snapshot, state = found
        position = self.position
        position.step, position.epoch, position.sample_index = state["step"], state["epoch"], state["sample_index"]
        try:
            self.optimization.scheduler.load_state_dict(state["scheduler"])
            self.optimization.scaler.load_state_dict(state["scaler"])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise checkpoint.SnapshotError(f"snapshot {snapshot}: its scheduler or scaler state does not fit "
                                           f"this run ({type(error).__name__}: {error})") from None
        self.saved_step, self.last_snapshot = position.step, snapshot
        saved_world = state.get("world_size", world_size)
        layout = f", saved by {saved_world} process(es), now {world_size}" if saved_world != world_size else ""
        logger.print(f"resuming from {snapshot}: step {position.step}/{total_steps}, epoch {position.epoch}, "
                     f"global sample {position.sample_index}{layout}")
        changed = _changed_keys(state.get("config", {}), to_dict(self.config))
        if changed:
            logger.print("config differs from the snapshot's: " + ", ".join(changed))

    def check_state(self, state: dict) -> None:
        """The trainer's own keys of a snapshot's state, type-checked against this run's objects
        (a snapshot that fails is treated as corrupt: the resume falls back to the previous one)."""
        def count(key: str) -> bool:
            return type(state.get(key)) is int and state[key] >= 0

        if not (count("epoch") and count("sample_index")
                and _same_shape(state.get("scheduler"), self.optimization.scheduler.state_dict())
                and _same_shape(state.get("scaler"), self.optimization.scaler.state_dict())
                and isinstance(state.get("config", {}), dict)):
            raise checkpoint.SnapshotCorruptError(
                f"snapshot step {state.get('step')}: state.json lacks or mistypes the trainer's keys "
                "(epoch, sample_index, scheduler, scaler)")


def check_saved_vocabulary(config: TrainConfig, vocab_size: int) -> None:
    """A resume reads the first vocab_size rows of the snapshot's embedding and head, whatever
    padding it was saved with: refuse, before any process group, a snapshot of another
    vocabulary (its rows would name other tokens). Read from the newest snapshot's validated
    state; a damaged one is left to the resume, which falls back from it and says why."""
    if not (config.trainer.resume or restart_count() > 0):
        return
    snapshot = checkpoint.latest_snapshot(snapshot_root(config))
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


def _same_shape(saved: object, current: object) -> bool:
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
