"""triax's training step against a minimal hand-written PyTorch loop, side by side.

Same model, same data, same optimizer, same process; the two are timed in alternating blocks so
load from anything else on the machine falls on both alike. Then tokens/s and MFU for fp32 and
bf16, and the addition task's accuracy after a short run.

    python benchmarks/trainer_vs_handwritten.py            # single process, 2-process DDP, precisions, addition
    python benchmarks/trainer_vs_handwritten.py --quick    # fewer rounds

The 2-process part re-runs this file under torchrun with --worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def trainer_for(run_dir: str, precision: str = "fp32", extra: list[str] | None = None):
    from triax.train.config import compose_config
    from triax.train.trainer import Trainer

    config = compose_config([f"trainer.run_dir={run_dir}", f"trainer.precision={precision}",
                             "trainer.eval_every=0", "trainer.max_steps=100000", *(extra or [])])
    trainer = Trainer(config)
    trainer.logger.enabled = False
    return trainer


class HandWritten:
    """The loop a PyTorch user writes by hand: model, DDP, AdamW, clip, step."""

    def __init__(self, trainer):
        from triax.models import GPT

        torch.manual_seed(0)
        self.device = trainer.device
        self.model = GPT(trainer.model_config).to(self.device)
        self.ddp = self.model
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=25,
                                                                 gradient_as_bucket_view=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
        self.data = trainer.data.train
        self.batch = trainer.config.trainer.batch_size
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(0))
        self.position = 0

    def train_step(self):
        start = self.position + self.rank * self.batch
        x, y = self.data.batch(self.order[start:start + self.batch])
        self.position += self.batch * self.world
        logits = self.ddp(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def time_block(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def compare(rounds: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        triax = trainer_for(run_dir)
        hand = HandWritten(triax)
        for _ in range(3):  # warm-up: allocator, thread pools, DDP buckets
            triax.train_step()
            hand.train_step()
        triax_times, hand_times = [], []
        for round_index in range(rounds):
            # Alternate which goes first so neither always follows the other.
            pair = [(triax_times, triax.train_step), (hand_times, hand.train_step)]
            for times, step in (pair if round_index % 2 == 0 else pair[::-1]):
                times.append(time_block(step, steps))
    triax_median, hand_median = statistics.median(triax_times), statistics.median(hand_times)
    return {"triax_step_s": triax_median, "handwritten_step_s": hand_median,
            "ratio": triax_median / hand_median,
            "triax_spread_s": [min(triax_times), max(triax_times)],
            "handwritten_spread_s": [min(hand_times), max(hand_times)]}


def precision_figures(steps: int, model: str) -> dict:
    results = {}
    for precision in ("fp32", "bf16"):
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = trainer_for(run_dir, precision, extra=[f"model={model}"])
            for _ in range(3):
                trainer.train_step()
            seconds = time_block(trainer.train_step, steps)
            figures = trainer._throughput(1, seconds)
            results[precision] = {"tokens_per_s": figures["tokens_per_s"], "mfu": figures["mfu"],
                                  "step_s": seconds}
            from triax.metrics import measure_peak_flops

            results[precision]["measured_peak_gflops"] = round(
                measure_peak_flops(trainer.device, trainer.precision.compute_dtype) / 1e9, 1)
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


def worker(args) -> None:
    from triax.runtime import shutdown_distributed

    result = compare(args.rounds, args.steps)
    if dist.get_rank() == 0:
        with open(args.output, "w") as handle:
            json.dump(result, handle)
    shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write all figures to this file")
    parser.add_argument("--precision-model", default="gpt-micro",
                        help="preset for the fp32/bf16 tokens/s and MFU figures")
    parser.add_argument("--only-precision", action="store_true", help="skip the other parts")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 4, 5
    if args.worker:
        return worker(args)

    from triax.testing import quiet_env, run_torchrun

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}; model gpt-micro "
          f"(triax train defaults: block 64, batch 32), fp32", flush=True)
    report = {}
    if args.only_precision:
        return print_precision(report, args)
    report["single"] = compare(args.rounds, args.steps)
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        # Two processes share the cores: one thread each.
        run_torchrun(2, [__file__, "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps),
                         "--output", output.name], timeout=1800, env=quiet_env())
        report["ddp2"] = json.load(open(output.name))
    for name, label in (("single", "1 process"), ("ddp2", "2-process DDP (gloo)")):
        r = report[name]
        print(f"{label:<22} triax {1000 * r['triax_step_s']:.1f} ms/step, hand-written "
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
