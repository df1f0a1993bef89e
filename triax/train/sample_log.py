"""debug.sample_log: which global samples each step consumed, one file per rank.

Used to check that a resumed run (on any number of processes) continues the exact sample sequence.
"""

from __future__ import annotations

from triax import safe_files


class SampleLog:
    """Appends "step epoch id id ..." lines to <prefix>.rank<N>; opened on the first record (so a
    Trainer that never trains leaves no file) and closed by `close`."""

    def __init__(self, prefix: str, rank: int):
        self.path = f"{prefix}.rank{rank}"
        self._file = None

    def record(self, step: int, epoch: int, sample_ids: list[int]) -> None:
        if self._file is None:
            # Line-buffered: a test that kills the process still finds every finished step's line.
            self._file = safe_files.open_append(self.path)
        self._file.write(f"{step} {epoch} {' '.join(map(str, sample_ids))}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
