"""How long Slurm's events take to reach triax, on a real Slurm (scripts/slurm_cluster.sh: slurmctld
and 2 slurmd nodes in network namespaces on this machine), with examples/slurm/train.sbatch as written:

- sbatch -> first step: submission to the first `step 1/N` line (scheduling, srun, Python and
  torch start-up, the rendezvous across nodes, model construction, the first step);
- preemption signal -> snapshot on disk: `scancel --batch --signal=USR1` (what `--signal=B:USR1@N`
  sends) to the snapshot's manifest being written (the batch shell passes USR1 to the step, every
  rank finishes its step and the snapshot is written);
- requeue -> first resumed step: the script's `scontrol requeue` to the resumed run's first step
  line. This includes Slurm's wait of `cred_expire` before a requeued job may start (30 s on this
  cluster, 120 s by Slurm's default), shown separately.

    sudo python benchmarks/slurm_timings.py --repeats 3

Prints the median and range of each over the repeats. Needs root, slurm-wlm and munge.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from triax import checkpoint  # noqa: E402
from triax.bench.slurm_cluster import SlurmCluster, unavailable_reason  # noqa: E402

CRED_EXPIRE_S = 30  # scripts/slurm_cluster.sh's AuthInfo cred_expire


def _wait(predicate, timeout: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise SystemExit(f"slurm_timings: {what} did not happen within {timeout:.0f} s")


def _text(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as handle:
        return handle.read()


def one_round(cluster: SlurmCluster, directory: str, corpus: str, model: list[str]) -> dict[str, float]:
    run_dir = os.path.join(directory, f"run-{time.monotonic_ns()}")
    overrides = [f"trainer.run_dir={run_dir}", f"data.path={corpus}", "trainer.max_steps=100000",
                 "trainer.log_every=1", "trainer.eval_every=0", "trainer.save_every=0", "trainer.sample_tokens=0",
                 *model]
    submitted = time.monotonic()
    job = cluster.sbatch([os.path.join(REPO, "examples", "slurm", "train.sbatch"), *overrides], cwd=directory)
    output = os.path.join(directory, f"triax-train-{job}.out")
    _wait(lambda: re.search(r"step 1/", _text(output)), 600, "the first step")
    first_step = time.monotonic()
    root = os.path.join(run_dir, "snapshots")
    cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
    signalled = time.monotonic()
    _wait(lambda: checkpoint.latest_snapshot(root), 300, "the stop snapshot")
    snapshot = time.monotonic()
    _wait(lambda: "requeueing job" in _text(output), 300, "the requeue")
    requeued = time.monotonic()
    _wait(lambda: re.search(r"\(restart 1\)(.|\n)*step \d+/", _text(output)), 600, "the first resumed step")
    resumed = time.monotonic()
    cluster.run(["scancel", str(job)])
    cluster.wait(job, timeout=120)
    return {"sbatch -> first step": first_step - submitted, "preemption signal -> snapshot on disk": snapshot - signalled,
            "requeue -> first resumed step": resumed - requeued}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"slurm_timings: no Slurm cluster can be made here: {reason}", file=sys.stderr)
        return 1
    model = [f"model.n_layer={args.layers}", "model.n_head=2", f"model.n_embd={args.width}", "data.block_size=32",
             "trainer.batch_size=8"]
    rounds = []
    with tempfile.TemporaryDirectory() as directory, SlurmCluster(nodes=2) as cluster:
        rng = random.Random(0)
        corpus = os.path.join(directory, "corpus.txt")
        with open(corpus, "w") as handle:
            handle.write("\n".join(" ".join(rng.choice(["the", "quick", "brown", "fox", "jumps"]) for _ in range(12))
                                   for _ in range(2000)))
        for repeat in range(args.repeats):
            rounds.append(one_round(cluster, directory, corpus, model))
            print(f"round {repeat + 1}: " + ", ".join(f"{name.strip()} {value:.1f} s" for name, value in rounds[-1].items()),
                  flush=True)
    print(f"\n2 nodes x 1 process, {args.layers} layers x {args.width}, {args.repeats} rounds (median, min-max):")
    for name in rounds[0]:
        values = [item[name] for item in rounds]
        print(f"{name:40s} {statistics.median(values):7.1f} s   ({min(values):.1f}-{max(values):.1f})")
    print(f"(requeue -> first resumed step includes Slurm's wait of cred_expire={CRED_EXPIRE_S} s before a requeued "
          "job may start; 120 s by Slurm's default)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
