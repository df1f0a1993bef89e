"""Cost of a training step in each parallel layout relative to one process, side by side in one run.

On a CPU machine with gloo this measures the *overhead* each layout adds (collectives, pipeline
bubbles, sharding bookkeeping, processes sharing the cores), not the speed-up a GPU cluster would
see: the processes share the machine's few cores (on 2 cores, two processes can each have one;
four oversubscribe them).

Two figures per layout:
- CPU s/step: CPU time of all processes together per step, from the difference between a long
  and a short run (so start-up cancels). It does not depend on how busy the machine is.
- wall s/step: the trainer's own step time over the last logging interval. On a shared machine
  a layout with more processes gets a larger share of the cores, so read it with care.

    python benchmarks/parallel_layouts.py [--steps 4 16] [--layouts single ddp2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from triax.testing import run, run_torchrun  # noqa: E402

GLOBAL_BATCH = 16
# name: (processes, per-data-parallel-rank batch, parallel.* settings)
LAYOUTS = {
    "single": (1, 16, {}),
    "ddp2": (2, 8, {"parallel.dp_replicate": 2}),
    "fsdp2": (2, 8, {"parallel.dp_shard": 2}),
    "tp2": (2, 16, {"parallel.tp": 2}),
    "pp2_gpipe": (2, 16, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    "pp2_1f1b": (2, 16, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    "fsdp2_tp2": (4, 8, {"parallel.dp_shard": 2, "parallel.tp": 2}),
    "pp2_dp2": (4, 8, {"parallel.pp": 2, "parallel.dp_replicate": 2}),
    "hsdp2x2": (4, 4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def step_cost(name: str, steps: int, workdir: str, corpus: str | None) -> tuple[float, float]:
    """(wall seconds per step of the last interval, CPU seconds of the whole run)."""
    nproc, batch, settings = LAYOUTS[name]
    values = {"model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "data.block_size": 64,
              "trainer.max_steps": steps, "trainer.batch_size": batch, "trainer.eval_every": 0,
              "trainer.log_every": steps // 2, "trainer.sample_tokens": 0,
              "trainer.run_dir": os.path.join(workdir, f"{name}_{steps}"), "parallel.dp_replicate": 1,
              **settings}
    if corpus:
        values["data.path"] = corpus
    args = ["-m", "triax", "train", *[f"{k}={v}" for k, v in values.items()]]
    before = children_cpu_s()
    if nproc == 1:
        run([sys.executable, *args], timeout=900)
    else:
        run_torchrun(nproc, args, timeout=900)
    cpu = children_cpu_s() - before
    records = [json.loads(line) for line in open(os.path.join(workdir, f"{name}_{steps}", "metrics.jsonl"))]
    # The last interval only: the first includes start-up (shape inference, allocator warm-up).
    return records[-1]["step_time_s"], cpu


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, nargs=2, default=[4, 28], help="a short and a long run")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--corpus", default=None, help="text file (default: the built-in corpus)")
    args = parser.parse_args()
    names = ["single"] + [n for n in args.layouts if n != "single"]
    short, long = args.steps
    cpu, wall = {}, {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            _, cpu_short = step_cost(name, short, workdir, args.corpus)
            wall[name], cpu_long = step_cost(name, long, workdir, args.corpus)
            cpu[name] = (cpu_long - cpu_short) / (long - short)
    print(f"GPT 4 layers x 128 wide, global batch {GLOBAL_BATCH} x 64 tokens, fp32, CPU gloo, "
          f"{os.cpu_count()} cores, one thread per process (overhead, not speed-up)")
    print(f"{'layout':<12} {'procs':>5} {'CPU s/step':>11} {'vs single':>10} {'wall s/step':>12} {'vs single':>10}")
    for name in names:
        print(f"{name:<12} {LAYOUTS[name][0]:>5} {cpu[name]:11.4f} {cpu[name] / cpu['single']:9.2f}x "
              f"{wall[name]:12.4f} {wall[name] / wall['single']:9.2f}x")
    print(f"load average during the run: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
