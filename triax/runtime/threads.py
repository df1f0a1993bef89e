"""The one thread rule of all commands that compute: train, eval, generate, doctor, tokenize, merge.

PyTorch's default is one thread per physical core, whatever else the machine runs. Its matmuls
split each operation across that team and wait at the end for the slowest thread, so one thread
that has to share its core with another program sets the pace of all of them: on a 2-core
machine that other jobs kept at a load of 4 to 6, twenty steps of the default run took 41 s,
then 15 s, against 7 s both times with one thread. On idle cores the whole team is the faster
choice. So the default asks for the cores that are idle when the command starts, and no more
than this process's share of the cores it may run on:

    threads = max(1, min(cores // local processes, round(idle cores)))

where `cores` are those of this process's CPU affinity and `idle cores` is how much of them was
idle over a short sample of /proc/stat taken while this process sleeps (IDLE_SAMPLE_SECONDS). Not
the one-minute load average: it follows a change over about a minute, so right after a pip
install or a finished job it still counts the cores that job held (a quickstart after the
install took one thread, 1 min 49 s, on two idle cores). Where /proc/stat cannot be read (not
Linux), the load average stands in.

OMP_NUM_THREADS, when set (torchrun sets 1 for several processes per host), is the user's
choice and stays; it is checked like an option (check_thread_setting: a whole number from 1 to
MAX_THREADS), before torch is imported, which would otherwise warn and carry on with its own.
`benchmarks/thread_default.py` measures the rule against one thread and PyTorch's default on idle
and loaded cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from triax.errors import UsageError

THREADS_ENV = "OMP_NUM_THREADS"
TOKENIZER_THREADS_ENV = "RAYON_NUM_THREADS"  # the Rust thread pool of Hugging Face tokenizers
MAX_THREADS = 4096  # more than any machine triax runs on has cores; 10**9 is a typo, not a choice
IDLE_SAMPLE_SECONDS = 0.2  # /proc/stat counts in 1/100 s: 20 ticks a core, enough to tell busy from idle
PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # for the run's first line: where the number comes from

    def describe(self) -> str:
        """'2 threads each (2 cores, 1.9 idle; OMP_NUM_THREADS to choose)'."""
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} each ({self.reason})"


def check_thread_setting(environment: dict[str, str] | None = None) -> int | None:
    """OMP_NUM_THREADS as a thread count, None when unset; a value that is not one is refused in
    one line (UsageError: exit 2 from the command line) rather than replaced by a default."""
    environment = os.environ if environment is None else environment
    given = environment.get(THREADS_ENV)
    if given is None or not given.strip():
        return None
    text = given.strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_THREADS:
        raise UsageError(f"{THREADS_ENV}={given[:40]!r} is not a thread count; set it to a whole number from 1 "
                         f"to {MAX_THREADS}, or unset it to let triax use the cores idle at the start")
    return int(text)


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity; all of them where that is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _cpu_times(cpus: list[int], path: str) -> tuple[int, int] | None:
    """(busy, total) clock ticks of the given CPUs so far, from /proc/stat; None if unreadable."""
    wanted = {f"cpu{cpu}" for cpu in cpus}
    busy = total = 0
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            lines = handle.read(1 << 20).splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if not fields or fields[0] not in wanted:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user already)
        ticks = [int(value) for value in fields[1:9] if value.isdigit()]
        if len(ticks) < 5:
            return None
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def idle_cores(cpus: list[int], seconds: float = IDLE_SAMPLE_SECONDS, path: str = PROC_STAT) -> float | None:
    """How many of `cpus` were idle over the next `seconds` (this process asleep meanwhile, so it
    counts only the others' work); None where /proc/stat cannot tell."""
    before = _cpu_times(cpus, path)
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times(cpus, path)
    if after is None or after[1] <= before[1]:
        return None
    busy_share = (after[0] - before[0]) / (after[1] - before[1])
    return max(0.0, len(cpus) * (1.0 - busy_share))


def _idle_from_load_average(cores: int) -> float | None:
    try:
        return max(0.0, cores - os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def choose_threads(local_processes: int, cores: int | None = None, idle: float | None = None,
                   environment: dict[str, str] | None = None) -> ThreadChoice:
    """The thread count of the rule above (arguments other than local_processes: for tests)."""
    given = check_thread_setting(environment)
    if given is not None:
        return ThreadChoice(given, f"{THREADS_ENV}={given}")
    if cores is None:
        cpus = usable_cores()
        cores = len(cpus)
        idle = idle_cores(cpus)
        if idle is None:
            idle = _idle_from_load_average(cores)
    share = max(1, cores // max(1, local_processes))
    if idle is None:
        return ThreadChoice(share, f"{cores} cores, {local_processes} per host; {THREADS_ENV} to choose")
    threads = max(1, min(share, round(idle)))
    return ThreadChoice(threads, f"{cores} cores, {min(idle, cores):.1f} idle; {THREADS_ENV} to choose")


def apply_thread_choice(local_processes: int = 1, torch_threads: bool = True) -> ThreadChoice:
    """Choose (see the module) and set this process's threads: torch's intra-op team (unless
    torch_threads is False: a command that never imports torch) and the pool Hugging Face
    tokenizers encode and train with (RAYON_NUM_THREADS, unless set). Every computing command
    calls this once, before its first tensor operation or tokenizer call."""
    choice = choose_threads(local_processes)
    os.environ.setdefault(TOKENIZER_THREADS_ENV, str(choice.threads))
    if torch_threads:
        import torch  # deferred: `triax tokenize` computes without it

        if choice.threads != torch.get_num_threads():
            torch.set_num_threads(choice.threads)
    return choice
