"""The Accelerator's experiment trackers: which were asked for (log_with), the ones started on the
main process by init_trackers, logging to all of them, and finishing them at end_training.

The trackers themselves are triax.accelerate.tracking's (Accelerate's GeneralTracker and its
destinations); this component only keeps the Accelerator's list of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triax.accelerate._internal.errors import AcceleratorValueError
from triax.accelerate.tracking import GeneralTracker, start_trackers

if TYPE_CHECKING:
    from triax.accelerate.state import AcceleratorState


class ExperimentTracking:
    """log_with and the started trackers of one Accelerator."""

    def __init__(self, state: AcceleratorState, log_with: list):
        self.state = state
        self.log_with = log_with
        self.trackers: list = []  # started by init_trackers, on the main process only

    def start(self, project_name: str, config: dict | None, init_kwargs: dict | None, logging_dir: str | None) -> None:
        if not self.state.is_main_process:
            return
        self.trackers.extend(start_trackers(self.log_with, project_name, logging_dir, init_kwargs or {}))
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get(self, name: str, unwrap: bool) -> object:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if self.trackers:
            raise AcceleratorValueError(f"{name} is not an available tracker stored inside the Accelerator "
                                        f"(it has {', '.join(t.name for t in self.trackers)})")
        return GeneralTracker(_blank=True)

    def log(self, values: dict, step: int | None, log_kwargs: dict | None) -> None:
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def finish(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()
