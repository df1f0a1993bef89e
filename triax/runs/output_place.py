"""The one rule for a command's output place (`triax export`'s output, `triax tokenize --out`).

Without torch: the run reader it needs (triax.runs.reader) is imported only when a run directory
lies on the way up from the output, so `triax tokenize`, which writes no model, starts in a tenth of
a second rather than a second."""

from __future__ import annotations

import os

from triax import safe_files
from triax.errors import TriaxError


def check_output_place(option: str, output: str, directory: bool = True) -> None:
    """Checked before anything expensive is read: the place can be made and written
    (safe_files.check_output_place), and it lies in no run's snapshots, kept files or own files,
    whichever run directory (one holding model.json) it lies in."""
    safe_files.check_output_place(option, output, directory)
    place = os.path.realpath(output)
    while True:
        if safe_files.is_regular(os.path.join(place, "model.json")):
            from triax.runs.reader import check_not_in_run, configured_snapshot_root  # deferred: see above

            try:
                root = configured_snapshot_root(place)
            except TriaxError:  # a damaged config.yaml: the trainer's default place
                root = os.path.join(place, "snapshots")
            check_not_in_run(output, place, root, option)
        if os.path.dirname(place) == place:
            return
        place = os.path.dirname(place)
