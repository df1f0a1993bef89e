"""`triax eval RUN` and `triax generate RUN` with triax's thread rule (triax/runtime/threads.py) against
OMP_NUM_THREADS=1 and against PyTorch's default (a thread per core), with --load busy processes
beside them (plain Python loops, as a neighbour's job would be; 0 for idle cores).

It trains one small run first (gpt-mini, --steps steps), then times each command with each
setting in turn, --rounds times (a change in the machine slows all settings alike), and prints the
median wall seconds of each and its ratio to OMP_NUM_THREADS=1's.

    python benchmarks/thread_commands.py                 # 2 busy processes, 3 rounds
    python benchmarks/thread_commands.py --load 0        # idle cores

Only a machine with nothing else running gives valid figures.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time

print = functools.partial(print, flush=True)  # noqa: A001 - progress shows up when piped to a file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triax.testing import quiet_env  # noqa: E402
from triax.runtime.threads import usable_cores  # noqa: E402

BUSY_LOOP = "while True: pass"


def environment(threads: str | None) -> dict[str, str]:
    env = quiet_env()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
    if threads is not None:
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    return env


def timed(command: list[str], threads: str | None, timeout: float) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "triax", *command], env=environment(threads), capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"triax {' '.join(command)} failed ({threads=}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=20, help="training steps of the run the commands read")
    parser.add_argument("--tokens", type=int, default=200, help="generate --tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the commands")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    cores = len(usable_cores())
    settings = {"triax default": None, "OMP_NUM_THREADS=1": "1", f"OMP_NUM_THREADS={cores} (torch's)": str(cores)}
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = os.path.join(scratch, "run")
        timed(["train", f"model={args.model}", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
               "trainer.sample_tokens=0", f"trainer.run_dir={run_dir}"], "1", args.timeout)
        commands = {"eval RUN": ["eval", run_dir],
                    f"generate RUN --tokens {args.tokens}": ["generate", run_dir, "--tokens", str(args.tokens)]}
        busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load)]
        try:
            time.sleep(2 if busy else 0)
            print(f"{cores} cores, {args.load} busy processes beside the commands; load {os.getloadavg()[0]:.1f}")
            times = {(c, s): [] for c in commands for s in settings}
            for round_number in range(args.rounds):
                for command, argv in commands.items():
                    for name, threads in settings.items():
                        seconds = timed(argv, threads, args.timeout)
                        times[(command, name)].append(seconds)
                        print(f"  [round {round_number + 1}] {command}, {name}: {seconds:.1f} s")
        finally:
            for process in busy:
                process.kill()
                process.wait()
    for command in commands:
        base = statistics.median(times[(command, "OMP_NUM_THREADS=1")])
        print(f"\n{command}: setting | median wall s | / OMP_NUM_THREADS=1's")
        for name in settings:
            seconds = statistics.median(times[(command, name)])
            print(f"  {name:<24} | {seconds:6.1f} | {seconds / base:5.2f}")


if __name__ == "__main__":
    main()
