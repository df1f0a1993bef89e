"""A `triax train` run directory as `triax export` reads it: the ExportedRun every writer of
triax/interop/exporters.py takes (its snapshot root found once, its newest good snapshot, its
model.json and config.yaml, its trained model, and the check that keeps an output out of the run's
own files), so the interop wing writes other tools' formats without importing this room."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from triax.checkpoint import SnapshotReader
from triax.models import GPTConfig
from triax.runs.chat_generate import load_chat_model, run_config
from triax.config import TrainConfig
from triax.runs.files import KEPT_SOURCE_DIR, read_model_config
from triax.runs.reader import check_not_in_run, newest_good_snapshot, run_snapshot_root, true_shapes, with_fallback


class RunToExport:
    """The run at `run_dir` (one line if it is not a run directory, before any output is checked)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.snapshot_root = run_snapshot_root(run_dir)
        self.kept_dir = os.path.join(run_dir, KEPT_SOURCE_DIR)

    def check_not_in_run(self, output: str, option: str = "output") -> None:
        check_not_in_run(output, self.run_dir, self.snapshot_root, option)

    def with_fallback(self, action: Callable[..., Any]) -> Any:
        return with_fallback(self.run_dir, self.snapshot_root, action)

    def true_shapes(self, model_config: GPTConfig, vocab: object) -> tuple[dict, dict]:
        return true_shapes(model_config, vocab)

    def newest_snapshot(self) -> SnapshotReader:
        return newest_good_snapshot(self.snapshot_root, self.run_dir, 0)

    def model_config(self) -> GPTConfig:
        return read_model_config(self.run_dir)

    def config(self) -> TrainConfig:
        return run_config(self.run_dir)

    def whole_model(self, config: TrainConfig, device: torch.device) -> torch.nn.Module:
        return load_chat_model(self.run_dir, config, device)
