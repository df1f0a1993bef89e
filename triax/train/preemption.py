"""Stopping cleanly on SIGTERM/SIGINT (a scheduler's preemption, Ctrl-C, torchrun shutting down).

The handler only raises a flag; the training loop checks it between steps, and all ranks agree on
it with one tiny all-reduce, so every rank stops after the same step, writes the same snapshot and
exits. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import signal
import sys
import threading


class StopRequest:
    def __init__(self, rank: int, preempt_at_step: int | None = None, preempt_rank: int = 0):
        """`preempt_at_step`/`preempt_rank` (the config's debug section): behave as if a signal
        reached rank `preempt_rank` right after step `preempt_at_step`, to stop a run at an exact step."""
        self.rank = rank
        self.reason: str | None = None
        self._previous: dict = {}
        self._injected_step = preempt_at_step
        self._injected_rank = preempt_rank

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: the user wants out now
        if not self.requested:
            self.reason = name
            print(f"triax: rank {self.rank} received {name}: finishing the current step, then writing "
                  "a snapshot (Ctrl-C again to abort without one)", file=sys.stderr, flush=True)

    def after_step(self, step: int) -> None:
        if step == self._injected_step and self.rank == self._injected_rank:
            self.reason = self.reason or f"debug.preempt_at_step={step}"
