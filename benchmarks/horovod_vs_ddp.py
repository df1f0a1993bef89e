"""Step time of one model trained with hvd.DistributedOptimizer against PyTorch DDP, side by side.

    python benchmarks/horovod_vs_ddp.py            # starts itself on 2 processes with torchrun
    python benchmarks/horovod_vs_ddp.py --width 1024 --depth 8 --rounds 7

Every variant trains its own copy of the same model on the same data. Variants are timed in
turns (round-robin), so load from other programs on the machine falls on all of them alike; the
median and the minimum step time of each are reported with their ratios to DDP, and the CPU time
per step (on a busy machine the wall-clock figures are noisy; CPU time shows the work each does):

- ddp:            torch.nn.parallel.DistributedDataParallel (25 MB buckets, its default)
- hvd:            hvd.DistributedOptimizer, Horovod's default 64 MB fusion, disagreement check on
- hvd-nocheck:    the same with the per-step check round off (TRIAX_HOROVOD_CHECK=0)
- hvd-4mb:        fusion threshold 4 MB: several buckets, so allreduces overlap backward
- hvd-per-param:  one allreduce per parameter (fusion off: HOROVOD_FUSION_THRESHOLD=0)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def parse_args(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16, help="linear layers (weight + bias each)")
    parser.add_argument("--batch", type=int, default=64, help="per process")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args(argv)


def make_model(args):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth - 1):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(args.width, 1))
    return torch.nn.Sequential(*layers)


def build_variants(args, hvd):
    from torch.nn.parallel import DistributedDataParallel

    variants = {}
    model = make_model(args)
    variants["ddp"] = (DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=1e-4), True)
    for name, threshold, check in (("hvd", None, True), ("hvd-nocheck", None, False),
                                   ("hvd-4mb", 4 * 1024 * 1024, True), ("hvd-per-param", 0, True)):
        if threshold is None:
            os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
        else:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = str(threshold)
        model = make_model(args)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                             named_parameters=model.named_parameters())
        variants[name] = (model, optimizer, check)
    os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)
    return variants


def time_steps(model, optimizer, batches, steps) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) per step."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=False)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps


def worker(args) -> None:
    import triax.horovod as hvd

    hvd.init()
    torch.manual_seed(1 + hvd.rank())
    batches = [(torch.randn(args.batch, args.width), torch.randn(args.batch, 1)) for _ in range(4)]
    variants = build_variants(args, hvd)
    times = {name: [] for name in variants}
    cpu_times = {name: [] for name in variants}
    for name, (model, optimizer, check) in variants.items():
        hvd.set_disagreement_check(check)
        time_steps(model, optimizer, batches, args.warmup)
    for _ in range(args.rounds):
        for name, (model, optimizer, check) in variants.items():
            hvd.set_disagreement_check(check)
            hvd.barrier()
            wall, cpu = time_steps(model, optimizer, batches, args.steps)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    # Every variant trained the same model on the same data: they must agree (sanity check).
    reference = [p.detach() for p in variants["ddp"][0].module.parameters()]
    for name, (model, _, _) in variants.items():
        params = model.module.parameters() if name == "ddp" else model.parameters()
        drift = max((a - b).abs().max().item() for a, b in zip(reference, params))
        assert drift < 1e-4, f"{name} drifted from ddp by {drift}"
    if hvd.rank() == 0:
        params = sum(p.numel() for p in variants["ddp"][0].parameters())
        tensors = len(list(variants["ddp"][0].parameters()))
        print(f"model: {args.depth} linear layers of {args.width}, {params / 1e6:.1f} M parameters "
              f"({params * 4 / 2**20:.0f} MiB fp32) in {tensors} tensors; batch {args.batch} per process; "
              f"{hvd.size()} processes, gloo, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"median of {args.rounds} rounds x {args.steps} steps, variants interleaved")
        base = statistics.median(times["ddp"])
        base_min = min(times["ddp"])
        base_cpu = statistics.median(cpu_times["ddp"])
        print(f"{'variant':<15}{'median ms':>10}{'vs ddp':>8}{'min ms':>9}{'vs ddp':>8}{'max ms':>9}"
              f"{'cpu ms':>9}{'vs ddp':>8}")
        for name, values in times.items():
            median, cpu = statistics.median(values), statistics.median(cpu_times[name])
            print(f"{name:<15}{median * 1e3:>10.1f}{median / base:>8.3f}{min(values) * 1e3:>9.1f}"
                  f"{min(values) / base_min:>8.3f}{max(values) * 1e3:>9.1f}{cpu * 1e3:>9.1f}{cpu / base_cpu:>8.3f}")
        print("cpu ms: CPU time of rank 0's process per step (all threads), median; less sensitive "
              "to other programs than wall time")
        fused, per_param = statistics.median(times["hvd"]), statistics.median(times["hvd-per-param"])
        print(f"fusion: one allreduce per parameter is {per_param / fused:.2f}x the fused step time (median), "
              f"{min(times['hvd-per-param']) / min(times['hvd']):.2f}x (min)")
    hvd.shutdown()


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    # Not under a launcher yet: start this script on N processes.
    from triax.testing import quiet_env, torchrun_command

    env = quiet_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), env.get("PYTHONPATH", "")]))
    command = torchrun_command(args.processes, [os.path.abspath(__file__), *sys.argv[1:]])
    import subprocess

    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
