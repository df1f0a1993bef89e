"""Experiment tracking for the Accelerator: Accelerate's `log_with`, over triax.trackers.

As in Accelerate: `log_with` takes a tracker name, a `LoggerType`, a tracker object of your own
(anything with `log` and `finish`, e.g. a subclass of Accelerate's GeneralTracker), a list of
those, or "all" (every tracker whose package is installed). A name Accelerate knows but whose
package is missing is left out; a name nobody knows is a ValueError. Trackers exist on the main
process only; elsewhere `log` does nothing.
"""

from __future__ import annotations

import warnings

from triax.accelerate.errors import AcceleratorValueError
from triax.trackers import TRACKERS, Tracker, available_trackers, install_hint, is_available

# Trackers Accelerate has and triax does not: named in log_with, they are left out with a warning.
ACCELERATE_ONLY = ("aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio")


def _is_tracker_object(candidate) -> bool:
    return not isinstance(candidate, str) and callable(getattr(candidate, "log", None)) \
        and callable(getattr(candidate, "finish", None))


def parse_log_with(log_with) -> list:
    """log_with as a list of tracker names (triax's) and tracker objects (the user's)."""
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    objects = [entry for entry in entries if _is_tracker_object(entry)]
    names = [str(getattr(entry, "value", entry)) for entry in entries if not _is_tracker_object(entry)]
    if "all" in names:
        return objects + available_trackers()
    chosen = []
    for name in names:
        if name in ACCELERATE_ONLY:
            warnings.warn(f"triax has no {name!r} tracker; nothing is logged to it (triax logs to "
                          f"{', '.join(TRACKERS)})", stacklevel=3)
        elif name not in TRACKERS:
            raise AcceleratorValueError(f"Unsupported logging capability: {name!r}; use any of "
                                        f"{', '.join(TRACKERS)}, 'all', or a tracker object")
        elif not is_available(name):
            warnings.warn(f"log_with={name!r}: its package is not installed, so it is left out "
                          f"(as Accelerate does); {install_hint(name)}", stacklevel=3)
        elif name not in chosen:
            chosen.append(name)
    return objects + chosen


class BlankTracker(Tracker):
    """What get_tracker returns on a process without trackers (Accelerate's blank GeneralTracker)."""

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        pass
