"""Stopping cleanly on SIGTERM/SIGINT/SIGUSR1 (a scheduler's preemption, Ctrl-C, torchrun shutting
down, Slurm's `--signal=USR1@N` warning before the time limit).

The handler only raises a flag; the training loop checks it between steps, and all ranks agree on
it with one tiny all-reduce, so every rank stops after the same step, writes the same snapshot and
exits. A step that outlasts `trainer.stop_grace` after the signal (a huge batch, a stuck kernel:
Python cannot interrupt a running operator) is not waited for: the process says where a restart
will begin and exits, as it would be killed anyway. A second Ctrl-C interrupts at once, saying the same.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable


# SIGUSR1: what Slurm users ask for with `--signal=USR1@N` (srun passes it to the tasks, where it
# would otherwise kill the process without a snapshot).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    def __init__(self, rank: int, preempt_at_step: int | None = None, preempt_rank: int = 0,
                 grace_s: float = 30.0, restart_point: Callable[[], str] | None = None):
        """`preempt_at_step`/`preempt_rank` (the config's debug section): behave as if a signal
        reached rank `preempt_rank` right after step `preempt_at_step`, to stop a run at an exact step.
        `restart_point()` says where a restart would begin, for a stop without a new snapshot."""
        self.rank = rank
        self.reason: str | None = None
        self._previous: dict = {}
        self._injected_step = preempt_at_step
        self._injected_rank = preempt_rank
        self._grace_s = grace_s
        self._restart_point = restart_point or (lambda: "a restart resumes from the last snapshot")
        self._deadline: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        self.reached()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def reached(self) -> None:
        """The loop has stopped at a step boundary: no deadline any more (the snapshot may take its time)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def request(self, reason: str, why: str) -> None:
        """Stop after the current step with a snapshot, as a signal would, for a reason found in the
        process (`why`: what happened, for the line on stderr)."""
        if not self.requested:
            self.reason = reason
            print(f"triax: rank {self.rank}: {why}: finishing the current step, then writing a snapshot",
                  file=sys.stderr, flush=True)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            self.reached()
            raise KeyboardInterrupt(self._restart_point())  # asked twice: the user wants out now
        if not self.requested:
            self.reason = name
            print(f"triax: rank {self.rank} received {name}: finishing the current step, then writing "
                  "a snapshot (Ctrl-C again to abort without one)", file=sys.stderr, flush=True)
            self._deadline = threading.Timer(self._grace_s, self._give_up, args=(signum,))
            self._deadline.daemon = True
            self._deadline.start()

    def _give_up(self, signum: int) -> None:
        """On the timer's thread: the step did not end within the grace; leave now, as a kill would."""
        print(f"triax: rank {self.rank}: the current step did not end within trainer.stop_grace="
              f"{self._grace_s:g} s of {signal.Signals(signum).name}; exiting: {self._restart_point()}",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def after_step(self, step: int) -> None:
        if step == self._injected_step and self.rank == self._injected_rank:
            self.reason = self.reason or f"debug.preempt_at_step={step}"
