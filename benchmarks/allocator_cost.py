"""What `trainer.return_freed_memory` costs in step time and saves in memory.

With it on (the default when FSDP shards the model) glibc hands every freed buffer of 4 MiB and
more back to the OS, so each large allocation gets fresh, zeroed pages: more system time per step,
less resident memory. This runs the same short training with it off (glibc's default) and on, in
turn (off, on, off, on, ...: a busy neighbour slows both alike), and prints per pair the median
step time of steps 2..N (the first step sets things up) and rank 0's peak resident memory, then
on/off ratios pair by pair.

    python benchmarks/allocator_cost.py                     # the default run (gpt-micro, 1 process)
    python benchmarks/allocator_cost.py --model gpt2-medium --nproc 2 --steps 4 \\
        --set parallel.dp_replicate=1 parallel.dp_shard=2 data.block_size=32 trainer.batch_size=1

Only a quiet machine gives valid seconds; the memory column holds under load.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile

print = functools.partial(print, flush=True)  # noqa: A001 - progress shows up when piped to a file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triax.testing import run, run_torchrun  # noqa: E402


def train_once(args, release: bool, run_dir: str) -> tuple[float, float]:
    """Median seconds per step after the first, and rank 0's peak resident MiB."""
    overrides = [f"model={args.model}", f"trainer.max_steps={args.steps}", "trainer.log_every=1",
                 "trainer.eval_every=0", "trainer.sample_tokens=0", "trainer.resume=false",
                 "trainer.overwrite=true", f"trainer.run_dir={run_dir}",
                 f"trainer.return_freed_memory={str(release).lower()}", *args.set]
    command = ["-m", "triax", "train", *overrides]
    if args.nproc > 1:
        run_torchrun(args.nproc, command, timeout=args.timeout)
    else:
        run([sys.executable, *command], timeout=args.timeout)
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    steps = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > 1]
    return statistics.median(steps), max(r["peak_mem_mb"] for r in records if "peak_mem_mb" in r)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-micro")
    parser.add_argument("--nproc", type=int, default=1, help="processes (torchrun when > 1)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2, help="pairs (off, on) to run")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more trainer settings")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be 2 or more (the first step is not timed)")
    load = os.getloadavg()[0]
    print(f"allocator_cost: {args.model}, {args.nproc} process(es), {args.steps} steps, "
          f"{' '.join(args.set) or 'default settings'}; load average {load:.1f} at start")
    print(f"{'pair':>4} {'off s/step':>11} {'on s/step':>10} {'on/off':>7} {'off MiB':>8} {'on MiB':>7} {'on/off':>7}")
    ratios = []
    with tempfile.TemporaryDirectory(prefix="triax_allocator_") as root:
        for pair in range(1, args.rounds + 1):
            off_s, off_mb = train_once(args, False, os.path.join(root, "off"))
            on_s, on_mb = train_once(args, True, os.path.join(root, "on"))
            ratios.append(on_s / off_s)
            print(f"{pair:>4} {off_s:>11.4f} {on_s:>10.4f} {on_s / off_s:>7.3f} {off_mb:>8.0f} {on_mb:>7.0f} "
                  f"{on_mb / off_mb:>7.3f}")
    print(f"step time on/off, pair by pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
