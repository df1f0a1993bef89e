"""Runs inside each torchrun job of `triax bench`: builds every requested way of writing the step,
warms them up, then times them in turn, repeat after repeat.

Interleaving (A, B, C, A, B, C, ...) rather than timing A fully then B means a slow spell on a
shared machine hits every way alike, so their ratios stay fair. Rank 0 writes the raw timings as
JSON; cli.py turns them into the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from triax.bench.adapters import ADAPTERS, StepSetup, Unavailable, make_step
from triax.bench.models import make_bench_model
from triax.tracking.throughput import peak_flops
from triax.runtime.place import detect_place, pick_device
from triax.runtime.precision import Precision
from triax.runtime.process_group import init_distributed, is_distributed, shutdown_distributed


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that describe the step; cli.py passes them through unchanged."""
    parser.add_argument("--model", default="gpt-nano", help="model preset (GPT or Llama) or 'mlp' (default gpt-nano)")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per process per step")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sample (GPT models)")
    # fp16 needs loss scaling, which would make the ways differ in more than their plumbing.
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--impls", default=",".join(name for name in ADAPTERS),
                        help=f"comma-separated ways of writing the step, of {', '.join(ADAPTERS)}; "
                             "WAY:COMPRESSION[:BUCKET_MB[:POWERSGD_RANK]] times a variant, e.g. triax:bf16, "
                             "ddp:none:5 or triax:powersgd::8")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per way first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per way (spread is over these)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size in MB")
    parser.add_argument("--grad-compression", default="none", choices=["none", "bf16", "fp16", "powersgd"])
    parser.add_argument("--powersgd-rank", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (CPU)")
    parser.add_argument("--sequential", action="store_true",
                        help="build and time one way at a time (less memory, less fair on a busy machine)")


def _all_agree(ok: bool) -> bool:
    """Whether every rank built its step: one rank alone must not go on into collectives."""
    if not is_distributed():
        return ok
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_block(step: Callable[[], float], steps: int, device: torch.device) -> tuple[float, float]:
    """Seconds per step over `steps` steps (the slowest rank's), and the last loss."""
    if is_distributed():
        dist.barrier()
    _sync(device)
    start = time.perf_counter()
    loss = None
    for _ in range(steps):
        loss = step()
    loss = float(loss)  # waits for the device
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if is_distributed():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() / steps, loss


def parse_impl(label: str, setup: StepSetup) -> tuple[str, StepSetup]:
    """'triax:bf16:5' -> ('triax', setup with grad_compression bf16 and 5 MB buckets);
    'triax:powersgd::8' -> PowerSGD of rank 8 with the default buckets."""
    name, *options = label.split(":")
    if name not in ADAPTERS:
        raise ValueError(f"unknown way {name!r}; choose from {', '.join(ADAPTERS)}")
    changes = {}
    if options and options[0]:
        changes["grad_compression"] = options[0]
    if len(options) > 1 and options[1]:
        changes["bucket_mb"] = float(options[1])
    if len(options) > 2 and options[2]:
        changes["powersgd_rank"] = int(options[2])
    return name, dataclasses.replace(setup, **changes)


def measure(names: list[str], setup: StepSetup, args: argparse.Namespace, results: dict) -> None:
    steps = {}
    for name in names:
        status, step = "ok", None
        try:
            adapter, variant = parse_impl(name, setup)
            step = make_step(adapter, variant)
        except Unavailable as reason:
            status = f"not available: {reason}"
        except Exception as error:  # noqa: BLE001 - a broken way is a row, not a crashed benchmark
            status = f"failed: {type(error).__name__}: {error}".splitlines()[0]
            if setup.rank == 0:
                traceback.print_exc()
        if not _all_agree(step is not None) and step is not None:
            status, step = "failed on another rank", None
        results[name] = {"status": status, "step_times": [], "losses": []}
        if step is not None:
            steps[name] = step
    for name, step in steps.items():
        for _ in range(args.warmup):
            step()
    for repeat in range(args.repeats):
        order = list(steps)
        # Rotate the order each repeat so no way always runs right after the same neighbour.
        order = order[repeat % max(len(order), 1):] + order[: repeat % max(len(order), 1)]
        for name in order:
            seconds, loss = _time_block(steps[name], args.steps, setup.device)
            results[name]["step_times"].append(seconds)
            results[name]["losses"].append(loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="triax.bench.worker")
    add_step_arguments(parser)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    place = detect_place()
    device = pick_device(args.device, place.local_rank)
    precision = Precision(args.precision)
    precision.check_device(device)
    model = make_bench_model(args.model, args.block_size)
    place = init_distributed(device, place)

    # Peak FLOP/s of this process while the others measure too: on a shared CPU that is the
    # share each process really gets. A GPU in the table uses its data-sheet figure.
    if is_distributed():
        dist.barrier()
    peak, peak_source = peak_flops(device, precision.compute_dtype)
    peak_tensor = torch.tensor([peak], dtype=torch.float64)
    if is_distributed():
        dist.all_reduce(peak_tensor)
        peak_tensor /= dist.get_world_size()

    names = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in names if name.split(":")[0] not in ADAPTERS]
    if unknown:
        print(f"triax bench: unknown --impls {unknown}; choose from {', '.join(ADAPTERS)}", file=sys.stderr)
        return 2
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="triax-bench-") as scratch:
        setup = StepSetup(model=model, device=device, precision=precision, batch_size=args.batch_size,
                          rank=place.rank, world_size=place.world_size, bucket_mb=args.bucket_mb,
                          grad_compression=args.grad_compression, powersgd_rank=args.powersgd_rank,
                          scratch_dir=scratch)
        groups = [[name] for name in names] if args.sequential else [names]
        for group in groups:
            measure(group, setup, args, results)
    if place.rank == 0:
        record = {
            "world_size": place.world_size, "num_nodes": place.num_nodes, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "peak_flops": peak_tensor.item(), "peak_flops_source": peak_source,
            "flops_per_sample": model.flops_per_sample, "tokens_per_sample": model.tokens_per_sample,
            "samples_per_step": args.batch_size * place.world_size, "impls": results,
            "args": vars(args), "torch": torch.__version__,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(record, handle, indent=1)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
