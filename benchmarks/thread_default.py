"""The default thread count of a CPU `triax train` (triax/runtime/threads.py) against one thread and
against PyTorch's default (a thread per core), on idle cores and on cores other programs keep busy.

For each machine state (idle, then loaded with --load busy processes: plain Python loops, as a
neighbour's job would be) this runs the same short training in turn with each thread setting
(triax, 1, cores; then again, --rounds times: a change in the machine slows all settings alike),
and prints per setting the median seconds per step after the first (metrics.jsonl) and the wall
time of the whole command, then each setting's ratio to triax's default.

    python benchmarks/thread_default.py                       # gpt-micro, 40 steps, load = 2 x cores
    python benchmarks/thread_default.py --steps 20 --load 4 --rounds 3

The default samples the idle cores at the start (/proc/stat), so the loaded runs start --settle
seconds after the busy processes (default 3 s), once those run. Only a
machine with nothing else running gives valid figures; run it there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
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


def train_once(args, threads: str | None, run_dir: str) -> tuple[float, float, str]:
    """(median seconds per step after the first, wall seconds, the run's first line)."""
    env = quiet_env()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
    if threads is not None:
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    overrides = [f"model={args.model}", f"trainer.max_steps={args.steps}", "trainer.log_every=1",
                 "trainer.eval_every=0", "trainer.sample_tokens=0", "trainer.resume=false",
                 "trainer.overwrite=true", f"trainer.run_dir={run_dir}", *args.set]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "triax", "train", *overrides], env=env, capture_output=True,
                          text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"triax train failed ({threads=}):\n{done.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    steps = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > 1]
    return statistics.median(steps), wall, done.stdout.splitlines()[0]


def measure(args, settings: dict[str, str | None], state: str) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as scratch:
        for round_number in range(args.rounds):
            for name, threads in settings.items():
                step_s, wall_s, first = train_once(args, threads, os.path.join(scratch, re.sub(r"[^A-Za-z0-9_.-]", "_", name)))
                results[name].append((step_s, wall_s))
                print(f"  [{state}, round {round_number + 1}] {name}: {step_s * 1000:.1f} ms/step, {wall_s:.1f} s "
                      f"wall; load {os.getloadavg()[0]:.1f}")
                if name == "triax default":
                    print(f"    {first}")
    return results


def report(state: str, results: dict[str, list[tuple[float, float]]]) -> None:
    base_step = statistics.median(step for step, _ in results["triax default"])
    print(f"\n{state}: setting | median ms/step | median wall s | step time / triax default's")
    for name, values in results.items():
        step = statistics.median(value[0] for value in values)
        wall = statistics.median(value[1] for value in values)
        print(f"  {name:<22} | {step * 1000:8.1f} | {wall:7.1f} | {step / base_step:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-micro")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--load", type=int, default=None, help="busy processes for the loaded runs (default 2 x cores)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between starting the load and measuring")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value overrides")
    args = parser.parse_args()
    cores = len(usable_cores())
    load = args.load if args.load is not None else 2 * cores
    settings = {"triax default": None, "OMP_NUM_THREADS=1": "1", f"OMP_NUM_THREADS={cores} (torch's)": str(cores)}
    print(f"{cores} cores; load average now {os.getloadavg()[0]:.1f} (should be near 0 for the idle runs)")
    idle = measure(args, settings, "idle")
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(load)]
    try:
        print(f"\n{load} busy processes started; waiting {args.settle:.0f} s for them to run")
        time.sleep(args.settle)
        loaded = measure(args, settings, f"loaded ({load} busy processes)")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    report("idle", idle)
    report(f"loaded ({load} busy processes on {cores} cores)", loaded)


if __name__ == "__main__":
    main()
