"""Stragglers: a rank that is persistently slower than the others.

Under data parallelism every rank waits for the slowest at each gradient all-reduce, so wall-clock
step times are nearly equal and hide the culprit. What differs is the work a rank does before it
waits: reading its batch (data) and its forward pass (compute; forward has no collectives under
DDP). A rank whose data + forward time per step exceeds the median of the other ranks' by
MARGIN in INTERVALS log intervals in a row is reported once, with the part that is slow.
"""

from __future__ import annotations

import statistics

MARGIN = 0.25  # 25% slower than the median of the other ranks
INTERVALS = 3  # ... in this many log intervals in a row


class StragglerCheck:
    def __init__(self, margin: float = MARGIN, intervals: int = INTERVALS):
        self.margin, self.intervals = margin, intervals
        self._strikes: dict[int, int] = {}

    def update(self, data_s: list[float], forward_s: list[float], hosts: dict[int, str] | None = None) -> list[str]:
        """Per-rank seconds per step of one log interval -> warnings for ranks that just became
        persistent stragglers."""
        warnings = []
        hosts = hosts or {}
        for rank in range(len(data_s)):
            others = [r for r in range(len(data_s)) if r != rank]
            if not others:
                return []
            work = data_s[rank] + forward_s[rank]
            median_data = statistics.median(data_s[r] for r in others)
            median_forward = statistics.median(forward_s[r] for r in others)
            median_work = median_data + median_forward
            if work <= (1 + self.margin) * median_work:
                self._strikes[rank] = 0
                continue
            self._strikes[rank] = self._strikes.get(rank, 0) + 1
            if self._strikes[rank] != self.intervals:
                continue
            cause = ("data loading" if data_s[rank] - median_data >= forward_s[rank] - median_forward
                     else "compute (its forward pass)")
            where = f" on {hosts[rank]}" if rank in hosts else ""
            warnings.append(
                f"rank {rank}{where} is a straggler: {work / max(median_work, 1e-9):.1f}x the median of the "
                f"other ranks (data + forward per step) in {self.intervals} log intervals in a row; data "
                f"{1e3 * data_s[rank]:.1f} ms vs {1e3 * median_data:.1f} ms, forward {1e3 * forward_s[rank]:.1f} ms "
                f"vs {1e3 * median_forward:.1f} ms: {cause} is the cause")
        return warnings
