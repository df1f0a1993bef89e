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

    times = []
    model.train()
    start = time.perf_counter()
    for tokens, labels in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens), labels)
        backward(loss)
        optimizer.step()
        scheduler.step()
        now = time.perf_counter()
        times.append(now - start)
        start = now
    if rank == 0:
        with open(args.result, "w") as handle:
            json.dump({"step_times": times[args.warmup:], "threads": torch.get_num_threads(),
                       "steps": len(times), "model": type(model).__name__}, handle)


def launch(framework: str, args, result: str) -> float:
    from triax.testing import quiet_env, run, torchrun_command

    command = torchrun_command(args.nproc, [os.path.abspath(__file__), "--worker", framework, "--result", result,
                                            "--steps", str(args.steps), "--warmup", str(args.warmup),
                                            "--batch-size", str(args.batch_size), "--seq", str(args.seq),
                                            "--width", str(args.width), "--layers", str(args.layers)])
    run(command, env=quiet_env(PYTHONPATH=ROOT), timeout=600)
    with open(result) as handle:
        return statistics.median(json.load(handle)["step_times"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    medians = {name: [] for name in frameworks}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name in frameworks:
                medians[name].append(launch(name, args, os.path.join(scratch, f"{name}_{round_index}.json")))
    step = {name: statistics.median(values) for name, values in medians.items()}
    print(f"torch {torch.__version__}, accelerate {hf_version}, {args.nproc} processes (CPU, gloo), "
          f"batch {args.batch_size}/process, seq {args.seq}, width {args.width}, {args.layers} layers, "
          f"{args.steps} timed steps x {args.rounds} rounds")
    print(f"{'loop':<22}{'median step ms':>16}{'per round (ms)':>28}")
    labels = {"triax": "triax.Accelerator", "hf": "HF Accelerate", "torch": "plain PyTorch DDP"}
    for name in frameworks:
        rounds = ", ".join(f"{value * 1e3:.1f}" for value in medians[name])
        print(f"{labels[name]:<22}{step[name] * 1e3:>16.2f}{rounds:>28}")
    if "hf" in step:
        print(f"ratio triax / HF Accelerate step time: {step['triax'] / step['hf']:.3f}")
    print(f"ratio triax / plain PyTorch step time: {step['triax'] / step['torch']:.3f}")


if __name__ == "__main__":
    main()
