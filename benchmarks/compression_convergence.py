"""Does compressed-gradient training still converge? `triax train` with 2 processes and each
parallel.grad_compression, same data, seed and steps; the loss against the uncompressed run.

    python benchmarks/compression_convergence.py --model gpt-mini --steps 200

Loss does not depend on the network, so this runs on loopback (the speed is measured by
benchmarks/netns_compression.py). Prints final training and validation loss per compression.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from triax.testing import quiet_env, run_torchrun  # noqa: E402

COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")


def train(run_dir: str, args, compression: str) -> list[dict]:
    overrides = [f"model={args.model}", f"trainer.max_steps={args.steps}", f"trainer.batch_size={args.batch_size}",
                 f"data.block_size={args.block_size}", f"trainer.run_dir={run_dir}", "trainer.sample_tokens=0",
                 f"trainer.eval_every={args.steps}", "trainer.log_every=10", "trainer.eval_batches=20",
                 f"parallel.grad_compression={compression}", f"parallel.powersgd_rank={args.powersgd_rank}"]
    run_torchrun(2, ["-m", "triax", "train", *overrides], timeout=3600, cwd=REPO,
                 env=quiet_env(PYTHONPATH=REPO))
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--compressions", default=",".join(COMPRESSIONS),
                        help="which to run; 'none' is always run as the reference")
    parser.add_argument("--out", default="bench-results/convergence.json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        chosen = ["none"] + [c for c in args.compressions.split(",") if c and c != "none"]
        for compression in chosen:
            records = train(os.path.join(scratch, compression), args, compression)
            last = records[-1]
            # Training loss averaged over the last 5 logged steps: one batch is noisy.
            tail = [r["loss"] for r in records if "loss" in r][-5:]
            results[compression] = {"train_loss_tail": sum(tail) / len(tail), "val_loss": last["val_loss"],
                                    "curve": [(r["step"], r["loss"]) for r in records if "loss" in r]}
            print(f"{compression:<9} train loss (last 5 logs) {results[compression]['train_loss_tail']:.4f}  "
                  f"val loss {last['val_loss']:.4f}", flush=True)
    reference = results["none"]
    print(f"\n{args.model}, 2 processes x batch {args.batch_size} x block {args.block_size}, {args.steps} steps")
    print(f"{'compression':<12}{'val loss':>10}{'Δ vs none':>11}{'train loss':>12}{'Δ vs none':>11}")
    for name, result in results.items():
        print(f"{name:<12}{result['val_loss']:>10.4f}{result['val_loss'] - reference['val_loss']:>+11.4f}"
              f"{result['train_loss_tail']:>12.4f}{result['train_loss_tail'] - reference['train_loss_tail']:>+11.4f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"command": "python benchmarks/compression_convergence.py " + " ".join(sys.argv[1:]),
                   "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
