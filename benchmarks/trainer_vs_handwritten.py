"""triax's training step against a minimal hand-written PyTorch loop, side by side.

Same model, same data, same optimizer: the step-time comparison is `triax bench --impls ddp,triax`
(the two loops live in triax/bench/adapters/; they are timed in alternating blocks so load from
anything else on the machine falls on both alike). Then tokens/s and MFU for fp32 and bf16 through
the Trainer, and the addition task's accuracy after a short run.

    python benchmarks/trainer_vs_handwritten.py            # single process, 2-process DDP, precisions, addition
    python benchmarks/trainer_vs_handwritten.py --quick    # fewer rounds
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def trainer_for(run_dir: str, precision: str = "fp32", extra: list[str] | None = None):
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    config = compose_config([f"trainer.run_dir={run_dir}", f"trainer.precision={precision}",
                             "trainer.eval_every=0", "trainer.max_steps=100000", *(extra or [])])
    trainer = Trainer(config)
    trainer.logger.enabled = False
    return trainer


def compare(rounds: int, steps: int, process_counts: str, out_dir: str) -> dict:
    """triax's step against the hand-written DDP loop, timed by `triax bench` (the same two loops:
    triax/bench/adapters/triax_trainer.py and plain_ddp.py), round-robin in one job per count."""
    from triax.commands.bench import main as bench

    bench(["--model", "gpt-micro", "--block-size", "64", "--batch-size", "32", "--impls", "ddp,triax",
           "--nproc", process_counts, "--repeats", str(rounds), "--steps", str(steps),
           "--threads", "1", "--no-chart", "--out", out_dir])
    with open(os.path.join(out_dir, "bench.json")) as handle:
        rows = json.load(handle)["rows"]
    result = {}
    for processes in sorted({row["processes"] for row in rows}):
        by_impl = {row["impl"]: row for row in rows if row["processes"] == processes}
        triax, hand = by_impl["triax"], by_impl["ddp"]
        result[processes] = {"triax_step_s": triax["step_time_s"], "handwritten_step_s": hand["step_time_s"],
                             "ratio": triax["step_time_s"] / hand["step_time_s"]}
    return result


def time_block(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def precision_figures(steps: int, model: str) -> dict:
    results = {}
    for precision in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = trainer_for(run_dir, precision, extra=[f"model={model}"])
            for _ in range(3):
                trainer.train_step()
            seconds = time_block(trainer.train_step, steps)
            figures = trainer.console.throughput(1, seconds)
            from triax.tracking.throughput import measure_peak_flops

            # The trainer reports MFU against a stated peak only; this benchmark, run side by side on
            # one quiet machine, states the matmul peak it measured there.
            peak = measure_peak_flops(trainer.device, trainer.precision.compute_dtype)
            results[precision] = {"tokens_per_s": figures["tokens_per_s"], "step_s": seconds,
                                  "mfu": trainer.flops_per_token * figures["tokens_per_s"] / peak,
                                  "measured_peak_gflops": round(peak / 1e9, 1)}
    return results


def addition_accuracy_figure(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = trainer_for(run_dir, extra=[
            "data.task=addition", "model.n_layer=2", "model.n_head=4", "model.n_embd=64",
            f"trainer.max_steps={steps}", "trainer.batch_size=64", "optim.lr=0.003",
            "optim.warmup_steps=20", "optim.weight_decay=0", "trainer.sample_tokens=0"])
        start = time.perf_counter()
        while trainer.step < steps:
            trainer.train_step()
        seconds = time.perf_counter() - start
        accuracy = trainer.evaluate()["val_accuracy"]
    return {"steps": steps, "held_out_problems": 500, "exact_match": accuracy, "train_seconds": round(seconds, 1)}


def print_precision(report: dict, args) -> None:
    report["precision"] = precision_figures(args.steps * 2, args.precision_model)
    for precision, r in report["precision"].items():
        print(f"{args.precision_model} {precision}: {r['tokens_per_s']:.0f} tokens/s, {1000 * r['step_s']:.0f} ms/step, "
              f"MFU {100 * r['mfu']:.1f}% of a measured {r['measured_peak_gflops']:.0f} GFLOP/s {precision} matmul peak")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", default="1,2", help="process counts for the step-time comparison")
    parser.add_argument("--json", help="also write all figures to this file")
    parser.add_argument("--precision-model", default="gpt-micro",
                        help="preset for the fp32/bf16 tokens/s and MFU figures")
    parser.add_argument("--only-precision", action="store_true", help="skip the other parts")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 4, 5
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; model gpt-micro "
          f"(triax train defaults: block 64, batch 32), fp32", flush=True)
    report = {}
    if args.only_precision:
        return print_precision(report, args)
    with tempfile.TemporaryDirectory() as out_dir:
        report["step_time"] = compare(args.rounds, args.steps, args.nproc, out_dir)
    for processes, r in report["step_time"].items():
        print(f"{processes} process(es): triax {1000 * r['triax_step_s']:.1f} ms/step, hand-written "
              f"{1000 * r['handwritten_step_s']:.1f} ms/step, ratio triax/hand-written {r['ratio']:.3f}")
    print_precision(report, args)
    report["addition"] = addition_accuracy_figure(300 if args.quick else 600)
    r = report["addition"]
    print(f"addition (2 digits): exact match {100 * r['exact_match']:.1f}% on {r['held_out_problems']} "
          f"held-out problems after {r['steps']} steps ({r['train_seconds']} s)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
