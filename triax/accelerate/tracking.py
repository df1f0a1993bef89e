"""Experiment tracking for the Accelerator: triax's MetricsLogger (JSONL + TensorBoard)."""

from __future__ import annotations

import json
import os

import torch

from triax.accelerate.errors import AcceleratorValueError
from triax.metrics import MetricsLogger

TRACKERS = ("tensorboard", "jsonl")


def parse_log_with(log_with) -> list[str]:
    """None -> [], "all" -> every tracker, a name or a list of names -> those names."""
    if log_with is None:
        return []
    names = [log_with] if isinstance(log_with, str) else list(log_with)
    if "all" in names:
        return list(TRACKERS)
    for name in names:
        if name not in TRACKERS:
            raise AcceleratorValueError(f"log_with={name!r} is not a tracker triax has; use one of "
                              f"{', '.join(TRACKERS)} or 'all'")
    return names


class Trackers:
    """The trackers of one run. Only the main process writes; the others hold a silent logger."""

    def __init__(self, names: list[str], run_dir: str, is_main: bool, config: dict | None):
        self.names = names
        self.run_dir = run_dir
        # MetricsLogger always writes metrics.jsonl (it is cheap and is triax's run record);
        # TensorBoard event files only when asked for.
        self.logger = MetricsLogger(run_dir, enabled=is_main and bool(names),
                                    tensorboard="tensorboard" in names, progress=False)
        self._next_step = 0
        if self.logger.enabled and config is not None:
            with open(os.path.join(run_dir, "config.json"), "w") as handle:
                json.dump(config, handle, indent=1, default=str)

    def log(self, values: dict, step: int | None = None) -> None:
        if step is None:
            step = self._next_step
        self._next_step = step + 1
        record = {key: value.item() if isinstance(value, torch.Tensor) else value
                  for key, value in values.items()}
        self.logger.log(step, record)

    def close(self) -> None:
        self.logger.close()
