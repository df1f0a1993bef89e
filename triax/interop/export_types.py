"""What an exporter is written against (triax/interop/exporters.py holds the table of them): the
run it reads, the command's options and the writer's form. A module of its own so each writer
can name these types without importing the table that imports every writer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from triax.models.config import GPTConfig


@dataclass
class ExportOptions:
    """The command's options a writer reads."""

    force: bool = False  # replace an existing output triax did not write
    merge: bool = False  # --format hf: a LoRA run's base with its adapters merged in


class ExportedRun(Protocol):
    """A `triax train` run as a writer reads it: its newest good snapshot and its files."""

    run_dir: str  # the run directory as given
    snapshot_root: str  # where it keeps its snapshots (found once, before any output is checked)
    kept_dir: str  # RUN/init_from/: the copies of its model.init_from checkpoint's files

    def check_not_in_run(self, output: str, option: str = "output") -> None:
        """Refuse an output inside the run's snapshots, its kept files, or one of its own files."""

    def with_fallback(self, action: Callable[..., Any]) -> Any:
        """`action(reader, model_config, vocab)` on the newest good snapshot, or the one before
        when its tensors turn out damaged."""

    def true_shapes(self, model_config: GPTConfig, vocab: object) -> tuple[dict, dict]:
        """(the model config without vocabulary padding, {tensor name: its unpadded shape})."""

    def newest_snapshot(self) -> Any:
        """The validated reader of the newest good snapshot."""

    def model_config(self) -> GPTConfig:
        """The run's model.json."""

    def config(self) -> Any:
        """The run's config.yaml (a TrainConfig)."""

    def whole_model(self, config: Any, device: torch.device) -> torch.nn.Module:
        """The run's trained plain model (a LoRA run's: its base with the snapshot's adapters)."""


Writer = Callable[[ExportedRun, str, ExportOptions], None]
