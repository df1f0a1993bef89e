"""Activation memory per rank under context parallelism: one process holding a long sequence
against parallel.cp=N ranks each holding 1/N of it, and `triax plan`'s estimate of both.

For each layout (1 process, then cp=N processes) the trainer takes one step at the long block and
one at a short block, each in its own launch, and every rank records its peak resident memory
during the step (VmHWM reset before it: benchmarks/memory_scaling.py's PeakMemory). The
activation memory of a layout is the largest rank's peak at the long block minus its peak at the
short block: the runtime, the weights, their gradients and AdamW's moments are the same in both
and cancel. The same difference of `triax plan`'s activation estimates stands beside it.

    python benchmarks/context_memory.py                        # llama, 8 layers 128 wide, block 16384, cp=2
    python benchmarks/context_memory.py --block-size 8192 --cp 2 4

Memory figures stay valid on a busy machine; the seconds it prints do not.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

print = functools.partial(print, flush=True)  # noqa: A001 - progress shows up when piped to a file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from memory_scaling import GIB, RECORDS_ENV, PeakMemory, _report, machine  # noqa: E402

SHORT_BLOCK = 256


def model_overrides(args, block: int, cp: int, corpus: str, run_dir: str) -> list[str]:
    values = {"model.arch": "llama", "model.n_layer": args.layers, "model.n_embd": args.width,
              "model.n_head": args.heads, "model.n_kv_head": args.kv_heads, "model.intermediate_size": 4 * args.width,
              "data.path": corpus, "data.block_size": block, "trainer.batch_size": 1, "trainer.max_steps": 1,
              "trainer.eval_every": 0, "trainer.sample_tokens": 0, "trainer.save_every": 0, "trainer.precision": "fp32",
              "trainer.run_dir": run_dir, "trainer.overwrite": "true", "trainer.log_every": 1,
              "trainer.loggers": "[jsonl]", "parallel.dp_replicate": 1, "parallel.cp": cp}
    return [f"{key}={value}" for key, value in values.items()]


def worker(overrides: list[str]) -> None:
    """One step of the trainer; each rank reports its peak during it and the plan's estimate."""
    from triax.parallel.plan import ModelShape, estimate
    from triax.runtime.process_group import shutdown_distributed
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    memory = PeakMemory()
    trainer = Trainer(compose_config(overrides))
    rank = int(os.environ.get("RANK", "0"))
    memory.reset()
    trainer.train_step()
    shape = ModelShape.from_config(trainer.model_config, block_size=trainer.data.block_size)
    planned = estimate(shape, trainer.layout, batch_size=1, precision="fp32").activations_gb * GIB
    _report(rank, phase="step", planned_activations=planned, **memory.peak())
    shutdown_distributed()


def launch(nproc: int, worker_args: list[str], timeout: float) -> list[dict]:
    """This script's worker under torchrun; every rank's records."""
    import subprocess
    import tempfile

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.abspath(__file__), *worker_args]
    with tempfile.TemporaryDirectory(prefix="triax_context_records_") as records_dir:
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env[RECORDS_ENV] = records_dir
        env.setdefault("OMP_NUM_THREADS", "1")
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if result.returncode != 0:
            raise SystemExit(f"{nproc} process(es) failed:\n{result.stderr[-3000:]}")
        return [json.loads(line) for name in sorted(os.listdir(records_dir))
                for line in open(os.path.join(records_dir, name))]


def write_corpus(path: str, characters: int) -> None:
    import random

    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "runs"]
    text = []
    while sum(map(len, text)) < characters:
        text.append(" ".join(rng.choice(words) for _ in range(12)))
    with open(path, "w") as handle:
        handle.write("\n".join(text))


def measure(args, cp: int, corpus: str, run_dir: str) -> dict:
    """(largest rank's peak at the long block - at the short block, plan's same difference)."""
    peaks = {}
    for block in (args.block_size, SHORT_BLOCK):
        rows = launch(cp, ["--worker", *model_overrides(args, block, cp, corpus, run_dir)], timeout=args.timeout)
        peaks[block] = (max(row["peak_rss"] for row in rows), rows[0]["planned_activations"])
    measured = peaks[args.block_size][0] - peaks[SHORT_BLOCK][0]
    planned = peaks[args.block_size][1] - peaks[SHORT_BLOCK][1]
    return {"cp": cp, "measured": measured, "planned": planned}


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-size", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="+", default=[2], help="context-parallel degrees (= processes)")
    # Deep and narrow: the activations kept for backward grow with the layers, while one layer's
    # working memory in backward (which plan does not count) does not.
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"llama, {args.layers} layers, {args.width} wide, {args.heads} heads on {args.kv_heads} key/value heads, "
          f"fp32, 1 sequence of {args.block_size} tokens (short block {SHORT_BLOCK})")
    with tempfile.TemporaryDirectory(prefix="triax_context_memory_") as scratch:
        corpus = os.path.join(scratch, "corpus.txt")
        write_corpus(corpus, 12 * args.block_size)
        rows = [measure(args, cp, corpus, os.path.join(scratch, f"cp{cp}")) for cp in [1, *args.cp]]
    one = rows[0]["measured"]
    print(f"{'layout':<10} {'measured GiB':>13} {'x 1 process':>12} {'plan GiB':>9} {'plan / measured':>16}")
    for row in rows:
        print(f"{'cp=' + str(row['cp']):<10} {row['measured'] / GIB:13.3f} {row['measured'] / one:12.2f} "
              f"{row['planned'] / GIB:9.3f} {row['planned'] / row['measured']:16.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
