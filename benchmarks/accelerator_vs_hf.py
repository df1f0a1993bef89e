"""Step time of a seed-003-style loop under triax.Accelerator, HF Accelerate, and plain PyTorch DDP.

Same model (a small Transformer encoder classifier), same synthetic data, same number of
processes (torchrun on the CPU with gloo), one run: the three loops are launched in turn,
`--rounds` times, interleaved so that machine load affects them alike. Prints the median step
time of each and the ratios against HF Accelerate and plain PyTorch.

    python benchmarks/accelerator_vs_hf.py [--nproc 2] [--steps 40] [--rounds 3]

HF Accelerate is a benchmark-only dependency (`pip install accelerate`); without it that
column is skipped.
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
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tokens(Dataset):
    def __init__(self, size, seq, vocab, classes):
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (size, seq), generator=generator)
        self.labels = torch.randint(0, classes, (size,), generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.tokens[index], self.labels[index]


class Classifier(torch.nn.Module):
    def __init__(self, vocab, width, layers, classes):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def worker(args) -> None:
    torch.manual_seed(0)
    model = Classifier(vocab=1000, width=args.width, layers=args.layers, classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dataset = Tokens(args.batch_size * int(os.environ["WORLD_SIZE"]) * (args.steps + args.warmup), args.seq, 1000, 10)

    if args.worker == "torch":
        # The hand-written equivalent: DDP and a DistributedSampler.
        import torch.distributed as dist
        from torch.utils.data.distributed import DistributedSampler

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
        data = DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset, seed=0))
        backward, rank = (lambda loss: loss.backward()), dist.get_rank()
    else:
        if args.worker == "triax":
            sys.path.insert(0, ROOT)
            from triax import Accelerator
        else:
            from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        data = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
        model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
        backward, rank = accelerator.backward, accelerator.process_index

    times, cpu_times = [], []
    model.train()
    start, cpu_start = time.perf_counter(), time.process_time()
    for tokens, labels in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens), labels)
        backward(loss)
        optimizer.step()
        scheduler.step()
        now, cpu_now = time.perf_counter(), time.process_time()
        times.append(now - start)
        cpu_times.append(cpu_now - cpu_start)
        start, cpu_start = now, cpu_now
    if rank == 0:
        with open(args.result, "w") as handle:
            json.dump({"step_times": times[args.warmup:], "cpu_times": cpu_times[args.warmup:],
                       "threads": torch.get_num_threads(), "steps": len(times)}, handle)


def launch(framework: str, args, result: str) -> tuple[float, float]:
    from triax.testing import quiet_env, run, torchrun_command

    command = torchrun_command(args.nproc, [os.path.abspath(__file__), "--worker", framework, "--result", result,
                                            "--steps", str(args.steps), "--warmup", str(args.warmup),
                                            "--batch-size", str(args.batch_size), "--seq", str(args.seq),
                                            "--width", str(args.width), "--layers", str(args.layers)])
    run(command, env=quiet_env(PYTHONPATH=ROOT), timeout=600)
    with open(result) as handle:
        record = json.load(handle)
    return statistics.median(record["step_times"]), statistics.median(record["cpu_times"])


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--worker", choices=["triax", "hf", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, ROOT)
    frameworks = ["triax", "torch"]
    try:
        import accelerate

        frameworks.insert(1, "hf")
        hf_version = accelerate.__version__
    except ImportError:
        hf_version = None
        print("HF Accelerate is not installed (pip install accelerate): its column is skipped")
    wall = {name: [] for name in frameworks}
    cpu = {name: [] for name in frameworks}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            # Rotate who goes first, so a drift in machine load does not favour one loop.
            shift = round_index % len(frameworks)
            for name in frameworks[shift:] + frameworks[:shift]:
                step, cpu_step = launch(name, args, os.path.join(scratch, f"{name}_{round_index}.json"))
                wall[name].append(step)
                cpu[name].append(cpu_step)
    print(f"torch {torch.__version__}, accelerate {hf_version}, {args.nproc} processes (CPU, gloo), "
          f"batch {args.batch_size}/process, seq {args.seq}, width {args.width}, {args.layers} layers, "
          f"{args.steps} timed steps x {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    # Wall time is what a user waits; CPU time per step (process 0) is the work the loop does
    # and is far less disturbed by other jobs on a shared machine.
    print(f"{'loop':<20}{'wall ms/step':>14}{'cpu ms/step':>13}   per-round wall (ms)")
    labels = {"triax": "triax.Accelerator", "hf": "HF Accelerate", "torch": "plain PyTorch DDP"}
    for name in frameworks:
        rounds = ", ".join(f"{value * 1e3:.0f}" for value in wall[name])
        print(f"{labels[name]:<20}{statistics.median(wall[name]) * 1e3:>14.1f}"
              f"{statistics.median(cpu[name]) * 1e3:>13.1f}   {rounds}")
    for other in ("hf", "torch"):
        if other in wall:
            # Ratios within each round (runs minutes apart) drift less than ratios of medians.
            paired = sorted(a / b for a, b in zip(wall["triax"], wall[other]))
            paired_cpu = sorted(a / b for a, b in zip(cpu["triax"], cpu[other]))
            print(f"ratio triax / {labels[other]}: wall {statistics.median(paired):.3f} "
                  f"(rounds {paired[0]:.2f}..{paired[-1]:.2f}), "
                  f"cpu {statistics.median(paired_cpu):.3f} (rounds {paired_cpu[0]:.2f}..{paired_cpu[-1]:.2f})")


if __name__ == "__main__":
    main()
