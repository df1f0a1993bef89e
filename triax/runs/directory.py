"""A training run's directory (trainer.run_dir): created only once every check passed, locked while
the run lives (triax.runs.lock), holding the files `triax generate`, `eval` and `export` read
besides the weights (config.yaml, model.json, the tokenizer or vocab.json), and the trackers' files.
A start that fails leaves nothing behind that it created."""

from __future__ import annotations

import json
import os
import shutil
import weakref
from typing import Protocol

import yaml

from triax import safe_files
from triax.errors import ConfigError
from triax.interop.foreign_run import ForeignRun
from triax.interop.hf.files import DESCRIPTION_FILES, MAX_DESCRIPTION_BYTES
from triax.models.config import GPTConfig
from triax.runtime.failure_agreement import raise_together
from triax.tracking.throughput import MetricsLogger
from triax.config.compose import to_dict
from triax.runs.files import KEPT_SOURCE_DIR
from triax.runs.lock import LOCK_NAME, lock_run_dir, unlock_run_dir
from triax.config.schema import TrainConfig


class RunText(Protocol):
    """What the run keeps of its data's text codec (the trainer's TrainData is one)."""

    tokenizer_path: str | None
    vocab: object


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


class RunDirectory:
    """One process's view of trainer.run_dir; rank 0 (`is_main`) alone writes and locks it."""

    def __init__(self, config: TrainConfig, is_main: bool):
        self.config, self.is_main = config, is_main
        self.path = config.trainer.run_dir

    def open(self, owner: object, created: bool, model_config: GPTConfig, data: RunText,
             init_source: ForeignRun | None) -> MetricsLogger:
        """The run lock, the trackers, and the files generate/export need (rank 0 writes them);
        returns the metrics logger. The lock is released when `owner` (the Trainer) goes away
        unfitted. A start that fails here (a full disk) removes what it created, and nothing else."""
        trainer, logger = self.config.trainer, None
        existing = set(os.listdir(self.path)) if self.is_main else set()
        # Rank 0 alone writes these; the ranks agree before the next collective (the resume), so
        # a failure there stops every rank at once instead of leaving the others waiting.
        with raise_together(f"writing the run files in {self.path}"):
            try:
                if self.is_main:
                    lock_run_dir(self.path)  # before anything in it is written or deleted
                    weakref.finalize(owner, unlock_run_dir, self.path, True)  # a Trainer never fitted
                logger = MetricsLogger(
                    self.path, enabled=self.is_main, loggers=trainer.loggers,
                    project=trainer.project, config=to_dict(self.config),
                    run_name=trainer.run_name or os.path.basename(os.path.normpath(self.path)))
                if self.is_main:
                    self.write_files(model_config, data, init_source)
            except OSError as error:
                if self.is_main:
                    if logger is not None:
                        logger.close()
                    _remove_new_entries(self.path, existing | {LOCK_NAME})
                    unlock_run_dir(self.path, remove=True)
                    if created:
                        remove_if_empty(self.path)
                raise ConfigError(f"cannot write {error.filename or 'the run files'} in trainer.run_dir "
                                  f"({error.strerror or error}); fix it or choose another run directory") from None
        return logger

    def write_files(self, model_config: GPTConfig, data: RunText, init_source: ForeignRun | None) -> None:
        """What `triax generate` and `triax export` need besides the weights."""
        run_dir = self.path
        # Atomic, never through a planted link: a link's target outside the run stays untouched.
        safe_files.write_atomic(os.path.join(run_dir, "config.yaml"),
                                yaml.safe_dump(to_dict(self.config), sort_keys=False))
        safe_files.write_atomic(os.path.join(run_dir, "model.json"), json.dumps(model_config.__dict__, indent=1))
        if data.tokenizer_path is not None:
            # The run carries its tokenizer, so generate/export need nothing but the run dir.
            safe_files.write_atomic(os.path.join(run_dir, "tokenizer.json"), data.vocab.json_text)
        elif data.vocab is not None:
            safe_files.write_atomic(os.path.join(run_dir, "vocab.json"), data.vocab.to_json())
        # A transformers model.init_from's config and tokenizer files, for a drop-in `--format hf` export.
        keep_description(init_source, run_dir)

    def release(self) -> None:
        """The run is over: no lock file stays behind."""
        if self.is_main:
            unlock_run_dir(self.path, remove=True)


def keep_description(source: ForeignRun | None, run_dir: str) -> None:
    """Copy the checkpoint's description files into the run (RUN/init_from/), replacing what an
    earlier start kept; a run without them keeps none. They are read now, with the weights, rather
    than from model.init_from at export time: by then the directory may be gone (a pruned cache
    snapshot) or hold another model (saved over), and the export must describe the checkpoint this
    run actually started from."""
    kept = os.path.join(run_dir, KEPT_SOURCE_DIR)
    description = source.description if source is not None else {}
    # Read before anything is replaced (model.init_from may be this very directory's parent run).
    contents = {name: safe_files.read_bytes(path, MAX_DESCRIPTION_BYTES) for name, path in description.items()}
    if contents:
        safe_files.make_directory(kept)
        for name, data in contents.items():
            safe_files.write_atomic(os.path.join(kept, name), data)
    if safe_files.is_directory(kept):
        for name in set(DESCRIPTION_FILES) - set(contents):
            safe_files.remove_file(os.path.join(kept, name))
        if not contents:
            try:
                os.rmdir(kept)
            except OSError:  # holds something triax did not write: left alone
                pass


def _remove_new_entries(directory: str, existing: set[str]) -> None:
    """Delete what appeared in `directory` besides `existing` (files, links unfollowed, directories)."""
    for name in set(os.listdir(directory)) - existing:
        path = os.path.join(directory, name)
        if safe_files.is_directory(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            safe_files.remove_file(path)


def remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
