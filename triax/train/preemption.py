"""Stopping cleanly on SIGTERM/SIGINT (a scheduler's preemption, Ctrl-C, torchrun shutting down).

The handler only raises a flag; the training loop checks it between steps, and all ranks agree on
it with one tiny all-reduce, so every rank stops after the same step, writes the same snapshot and
exits. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

# Test-only: behave as if a signal arrived on rank TRIAX_TEST_PREEMPT_RANK (default 0) right after
# step TRIAX_TEST_PREEMPT_AT_STEP, so a test can stop a run at an exact step.
PREEMPT_AT_STEP_ENV = "TRIAX_TEST_PREEMPT_AT_STEP"
PREEMPT_RANK_ENV = "TRIAX_TEST_PREEMPT_RANK"


class StopRequest:
    def __init__(self, rank: int):
        self.rank = rank
        self.reason: str | None = None
        self._previous: dict = {}
        at_step = os.environ.get(PREEMPT_AT_STEP_ENV, "")
        self._test_step = int(at_step) if at_step else None
        self._test_rank = int(os.environ.get(PREEMPT_RANK_ENV, "0") or 0)

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
        if self._test_step is not None and step == self._test_step and self.rank == self._test_rank:
            self.reason = self.reason or f"{PREEMPT_AT_STEP_ENV}={step}"
