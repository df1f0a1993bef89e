"""How many threads a CPU training process computes with, when nobody said.

PyTorch's default is one thread per physical core, whatever else the machine runs. Its matmuls
split each operation across that team and wait at the end for the slowest thread, so one thread
that has to share its core with another program sets the pace of all of them: on a 2-core
machine that other jobs kept at a load of 4 to 6, twenty steps of the default run took 41 s,
then 15 s, against 7 s both times with one thread. On idle cores the whole team is the faster
choice. So the default asks for the cores that are idle when the run starts, and no more than
this process's share of the cores it may run on:

    threads = max(1, min(cores // local processes, round(cores - load)))

where `cores` are those of this process's CPU affinity and `load` is the one-minute load average
(the processes running or waiting to run). An idle machine gets PyTorch's choice (or its share,
under several processes on one host); a loaded one fewer threads, down to one. OMP_NUM_THREADS,
when set (torchrun sets 1 for several processes per host), is the user's choice and stays.
`benchmarks/thread_default.py` measures the rule against one thread and PyTorch's default on idle
and loaded cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

THREADS_ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # for the run's first line: where the number comes from

    def describe(self) -> str:
        """'2 threads each (2 cores, load 0.1; OMP_NUM_THREADS to choose)'."""
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} each ({self.reason})"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def choose_threads(local_processes: int, cores: int | None = None, load: float | None = None,
                   environment: dict[str, str] | None = None) -> ThreadChoice:
    """The thread count of the rule above (arguments other than local_processes: for tests)."""
    environment = os.environ if environment is None else environment
    given = environment.get(THREADS_ENV, "").strip()
    if given:
        return ThreadChoice(torch.get_num_threads(), f"{THREADS_ENV}={given}")
    cores = usable_cores() if cores is None else cores
    load = load_average() if load is None else load
    share = max(1, cores // max(1, local_processes))
    if load is None:
        return ThreadChoice(share, f"{cores} cores, {local_processes} per host; {THREADS_ENV} to choose")
    idle = max(1, round(cores - load))
    threads = min(share, idle)
    return ThreadChoice(threads, f"{cores} cores, load {load:.1f}; {THREADS_ENV} to choose")


def apply_thread_choice(local_processes: int) -> ThreadChoice:
    """Choose (see the module) and set this process's intra-op threads."""
    choice = choose_threads(local_processes)
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    return choice
