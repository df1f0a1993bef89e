"""What snapshots cost.

1. Write and load time of a triax snapshot for a GPT model with its AdamW state (default: gpt2,
   124M parameters, tied embeddings), side by side with the seed-000 way of saving the same state
   (torch.save of the state dicts, torch.load(weights_only=True) to read it back). triax does more
   per byte (sha256 of every file, fsync, rename, RNG states), so the ratio is the price of that.
2. The slowdown of a small training run (gpt-micro) that snapshots every 50 steps, against the same
   run saving only at the end. Runs alternate (none, every 50, none, every 50, ...) and the best of
   each is compared, so a busy neighbour on a shared machine hurts both alike.

    OMP_NUM_THREADS=2 python benchmarks/snapshot_bench.py [--model gpt2] [--repeats 3] [--steps 200]
        [--rounds 3] [--batch-size 8] [--skip-snapshot] [--skip-training]
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
from triax.optim import make_adamw  # noqa: E402


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
    from triax.train.config import compose_config
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="training part: samples per step")
    parser.add_argument("--skip-snapshot", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="triax-snapshot-bench-")
    try:
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
