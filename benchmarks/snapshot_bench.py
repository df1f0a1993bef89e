"""What snapshots cost.

1. Write and load time of a (single-process) triax snapshot for a GPT model with its AdamW state (default: gpt2,
   124M parameters, tied embeddings), side by side with the seed-000 way of saving the same state
   (torch.save of the state dicts, torch.load(weights_only=True) to read it back). triax does more
   per byte (sha256 of every file, fsync, rename, RNG states), so the ratio is the price of that.
2. The slowdown of a small training run (gpt-micro) that snapshots every 50 steps, against the same
   run saving only at the end. Runs alternate (none, every 50, none, every 50, ...) and the best of
   each is compared, so a busy neighbour on a shared machine hurts both alike.
3. `--ranks 1,2,4`: sharded snapshots against the number of processes. For each N, FSDP x N under
   torchrun: seconds per rank to write a snapshot (synchronous), the step-loop pause of an
   asynchronous one (`trainer.async_save`: the CPU copy only) and its time to durable, seconds to
   resume, bytes each rank wrote and read, and peak resident memory per rank; ratios against N=1.

    OMP_NUM_THREADS=2 python benchmarks/snapshot_bench.py [--model gpt2] [--repeats 3] [--steps 200]
        [--rounds 3] [--batch-size 8] [--skip-snapshot] [--skip-training] [--ranks 1,2,4]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time

import torch

print = functools.partial(print, flush=True)  # noqa: A001 - progress shows up when piped to a file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triax import checkpoint  # noqa: E402
from triax.models import GPT, GPTConfig  # noqa: E402
from triax.train.optim import make_adamw  # noqa: E402


def directory_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names) / 2**20


def model_and_optimizer(preset: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(preset, vocab_size=50257, block_size=1024, tie_embeddings=True))
    optimizer = make_adamw(model, 1e-4, 0.1)
    tokens = torch.randint(0, 50257, (1, 32))
    model(tokens).float().mean().backward()  # one step, so AdamW has its moment buffers
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def bench_snapshot(preset: str, repeats: int, root: str) -> None:
    model, optimizer = model_and_optimizer(preset)
    fresh_model, fresh_optimizer = model_and_optimizer(preset)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    state = {"epoch": 0, "sample_index": 0}
    triax_save, triax_load, plain_save, plain_load = [], [], [], []
    for attempt in range(repeats):
        start = time.perf_counter()
        path = checkpoint.save_snapshot(os.path.join(root, "triax"), attempt + 1, model, optimizer, state, keep_last=1)
        triax_save.append(time.perf_counter() - start)
        start = time.perf_counter()
        checkpoint.load_snapshot(path, fresh_model, fresh_optimizer)
        triax_load.append(time.perf_counter() - start)

        plain = os.path.join(root, "plain.pt")
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)
        plain_save.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = torch.load(plain, weights_only=True)
        fresh_model.load_state_dict(loaded["model"])
        fresh_optimizer.load_state_dict(loaded["optimizer"])
        plain_load.append(time.perf_counter() - start)
    size, plain_size = directory_mb(path), os.path.getsize(plain) / 2**20
    print(f"snapshot of {preset} ({params:.1f}M parameters) + AdamW state, best of {repeats}:")
    print(f"  {'':28}{'write s':>9}{'load s':>9}{'MB':>8}")
    print(f"  {'triax snapshot':28}{min(triax_save):9.2f}{min(triax_load):9.2f}{size:8.0f}")
    print(f"  {'torch.save / torch.load':28}{min(plain_save):9.2f}{min(plain_load):9.2f}{plain_size:8.0f}")
    print(f"  {'ratio triax / torch':28}{min(triax_save) / min(plain_save):9.2f}{min(triax_load) / min(plain_load):9.2f}")
    print("  (loads read from the page cache: the files were just written)")


def bench_training(steps: int, rounds: int, batch_size: int, root: str) -> None:
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    def run(save_every: int) -> float:
        run_dir = os.path.join(root, f"run_{save_every}")
        shutil.rmtree(run_dir, ignore_errors=True)
        config = compose_config(["model=gpt-micro", f"trainer.max_steps={steps}", "trainer.eval_every=0",
                                 f"trainer.batch_size={batch_size}",
                                 f"trainer.log_every={steps}", "trainer.sample_tokens=0",
                                 f"trainer.save_every={save_every}", f"trainer.run_dir={run_dir}"])
        trainer = Trainer(config)
        start = time.perf_counter()
        trainer.fit()
        return time.perf_counter() - start

    times = {0: [], 50: []}
    for _ in range(rounds):
        for save_every in (0, 50):
            times[save_every].append(run(save_every))
    base, saving = min(times[0]), min(times[50])
    print(f"training gpt-micro (batch {batch_size}) for {steps} steps, best of {rounds} alternating runs:")
    print(f"  save only at the end:   {base:7.2f} s  ({[round(t, 2) for t in times[0]]})")
    print(f"  save_every=50:          {saving:7.2f} s  ({[round(t, 2) for t in times[50]]})")
    print(f"  slowdown: {100 * (saving / base - 1):+.1f}% ({steps // 50 - 1} extra snapshots)")


def sharded_worker(args) -> None:
    """One rank of `--ranks`: FSDP x world over a gpt preset, timed save/async/load."""
    import json
    import resource

    from triax.runtime.shared_decisions import barrier
    from triax.runtime.process_group import shutdown_distributed
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    run_dir = os.path.join(args.dir, f"ranks_{os.environ['WORLD_SIZE']}")
    trainer = Trainer(compose_config([
        f"model={args.model}", "trainer.max_steps=1", "trainer.batch_size=1", "data.block_size=32",
        "trainer.eval_every=0", "trainer.sample_tokens=0", f"trainer.run_dir={run_dir}", "trainer.resume=false",
        "trainer.overwrite=true", "parallel.dp_replicate=1", "parallel.dp_shard=-1"]))
    trainer.train_step()  # AdamW's moment buffers exist from here on
    root = trainer.snapshot_root
    barrier()
    start = time.perf_counter()
    path = checkpoint.save_snapshot(root, 1, trainer.model, trainer.optimizer, {"epoch": 0})
    write_s = time.perf_counter() - start
    barrier()
    start = time.perf_counter()
    pending = checkpoint.start_snapshot(root, 2, trainer.model, trainer.optimizer, {"epoch": 0}, asynchronous=True)
    pause_s = time.perf_counter() - start
    pending.wait()
    durable_s = time.perf_counter() - start
    barrier()
    stats = {}
    start = time.perf_counter()
    checkpoint.load_snapshot(path, trainer.model, trainer.optimizer, stats=stats)
    load_s = time.perf_counter() - start
    rank = trainer.rank
    written = os.path.getsize(os.path.join(path, "shards", f"rank_{rank:05d}.bin")) if os.path.exists(
        os.path.join(path, "shards", f"rank_{rank:05d}.bin")) else 0
    print("BENCH " + json.dumps({"rank": rank, "write_s": write_s, "async_pause_s": pause_s, "async_durable_s": durable_s,
                                 "load_s": load_s, "bytes_written": written, "bytes_read": stats["bytes_read"],
                                 "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
    del trainer
    shutdown_distributed()


def bench_sharded(model: str, ranks: list[int], root: str) -> None:
    import json
    import subprocess

    rows = {}
    for world in ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   os.path.abspath(__file__), "--worker", "--model", model, "--dir", root]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        output = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
        reports = [json.loads(line.split("BENCH ", 1)[1]) for line in output.splitlines() if "BENCH " in line]
        rows[world] = {key: max(r[key] for r in reports) for key in reports[0] if key != "rank"}
        rows[world]["bytes_written_min"] = min(r["bytes_written"] for r in reports)
    base = rows[ranks[0]]
    print(f"sharded snapshots of {model} + AdamW, FSDP x N (slowest rank; ratio against N={ranks[0]}):")
    print(f"  {'N':>3}{'write s':>10}{'async pause s':>15}{'async durable s':>17}{'load s':>9}"
          f"{'MB written/rank':>17}{'MB read/rank':>14}{'peak RSS MB':>13}")
    for world, row in rows.items():
        print(f"  {world:>3}{row['write_s']:10.2f}{row['async_pause_s']:15.2f}{row['async_durable_s']:17.2f}"
              f"{row['load_s']:9.2f}{row['bytes_written'] / 2**20:17.1f}{row['bytes_read'] / 2**20:14.1f}"
              f"{row['peak_rss_mb']:13.0f}")
        print(f"  {'':>3}{row['write_s'] / base['write_s']:10.2f}{row['async_pause_s'] / base['async_pause_s']:15.2f}"
              f"{row['async_durable_s'] / base['async_durable_s']:17.2f}{row['load_s'] / base['load_s']:9.2f}"
              f"{row['bytes_written'] / max(base['bytes_written'], 1):17.2f}{row['bytes_read'] / base['bytes_read']:14.2f}"
              f"{row['peak_rss_mb'] / base['peak_rss_mb']:13.2f}  (ratios)")


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="training part: samples per step")
    parser.add_argument("--skip-snapshot", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--ranks", default=None, help="e.g. 1,2,4: sharded snapshots against the process count")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sharded_worker(args)
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="triax-snapshot-bench-")
    try:
        if args.ranks:
            bench_sharded(args.model, [int(n) for n in args.ranks.split(",")], root)
            return 0
        if not args.skip_snapshot:
            bench_snapshot(args.model, args.repeats, root)
        if not args.skip_training:
            bench_training(args.steps, args.rounds, args.batch_size, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
