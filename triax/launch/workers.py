"""torchrun's workers as `triax launch` sees them: it runs torchrun's agent in this process, and the
agent starts each worker as a `subprocess.Popen` in a session of its own.

Two things the agent does not do, which a scheduler needs:
- pass on SIGUSR1/SIGUSR2: srun delivers them to this process only (the workers are in other
  sessions), and their default action would kill the agent and leave the workers orphaned. Slurm
  users ask for USR1 before the time limit (`--signal=USR1@N`), so it is forwarded to every worker.
- say how the workers ended after a SIGTERM: the agent forwards SIGTERM, waits for the workers and
  then raises SignalException, so torchrun exits 1 with a traceback even when every worker stopped
  cleanly and exited 0, and Slurm records a failed job. `exit_codes` reads the workers' own codes.

The workers are found as this process's Popen objects made after `snapshot()` (the agent keeps
them until it returns), so no torch internals are touched. `type(item)`, not isinstance: the latter
asks each object for its __class__, which some of torch's deprecated aliases answer with a warning.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def snapshot() -> set[int]:
    """The Popen objects that exist now (not workers): pass to `started_since`."""
    return {id(item) for item in gc.get_objects() if issubclass(type(item), subprocess.Popen)}


def started_since(before: set[int]) -> list[subprocess.Popen]:
    return [item for item in gc.get_objects() if issubclass(type(item), subprocess.Popen) and id(item) not in before]


def forward_signals(before: set[int]) -> dict:
    """Forward FORWARDED_SIGNALS to every live worker (its whole session: a worker's own children too).
    Returns the previous handlers, for `restore`."""

    def forward(signum: int, frame: FrameType | None):
        for worker in started_since(before):
            if worker.poll() is None:
                try:
                    os.killpg(worker.pid, signum)
                except ProcessLookupError:
                    pass

    return {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}


def restore(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def exit_codes(before: set[int]) -> list[int | None]:
    """Each worker's exit code (None: still running), in start order."""
    return [worker.poll() for worker in started_since(before)]
