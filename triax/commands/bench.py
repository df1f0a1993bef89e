"""`triax bench`: time one training step written several ways, for 1..N processes, side by side.

    triax bench --model gpt-mini --nproc 1,2 --out bench-results

starts one torchrun job per process count (each runs triax.bench.worker), prints the table and
writes bench-results/bench.json and bench-results/bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

from triax import safe_files
from triax.arguments import ArgumentParser, at_least, check_device, need, positive
from triax.bench import report
from triax.bench.jobs import run_job
from triax.bench.worker import add_step_arguments
from triax.errors import TriaxError, UsageError


def parse_process_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise TriaxError(f"--nproc wants process counts like 1,2,4; got {text!r}")
    return counts


def check_choices(args: argparse.Namespace) -> None:
    """Mistakes found here cost nothing; found in the workers they cost a torchrun start each."""
    from triax.bench.adapters import ADAPTERS  # deferred: the adapters import torch and the peers
    from triax.bench.models import model_names  # deferred: as the adapters

    if args.model not in model_names():
        raise TriaxError(f"unknown --model {args.model!r}; choose one of {', '.join(model_names())}")
    for label in args.impls.split(","):
        name, *options = label.strip().split(":")
        if name not in ADAPTERS:
            raise TriaxError(f"unknown way {name!r} in --impls; choose from {', '.join(ADAPTERS)}")
        if options and options[0] and options[0] not in ("none", "bf16", "fp16", "powersgd"):
            raise TriaxError(f"unknown compression {options[0]!r} in --impls {label!r}; "
                             "use none, bf16, fp16 or powersgd")
    for name in ("batch_size", "block_size", "steps", "repeats", "threads", "powersgd_rank"):
        at_least(f"--{name.replace('_', '-')}", getattr(args, name), 1)
    at_least("--warmup", args.warmup, 0)
    positive("--bucket-mb", args.bucket_mb)
    positive("--timeout", args.timeout)
    check_device("--device", args.device)
    check_out_directory(args.out, args.force)


# What `triax bench` writes into --out; a file of these names triax did not write is not replaced.
def _is_bench_json(path: str) -> bool:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and ("rows" in data or "peak_flops" in data)


def check_out_directory(out: str, force: bool) -> None:
    """--out is a directory (created if missing); refuse an existing file there, or result files
    triax did not write, unless --force."""
    need(out.strip() != "", "--out", out, "give a directory")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out!r} exists and is not a directory; give a directory for bench.json "
                         "and bench.png")
    if force or not os.path.isdir(out):
        return
    ours = ["bench.json", *(name for name in os.listdir(out) if re.fullmatch(r"raw-\d+\.json", name))]
    for name in ours:
        path = os.path.join(out, name)
        if os.path.lexists(path) and not _is_bench_json(path):
            raise UsageError(f"--out {out!r} already holds {name}, which triax bench did not write; choose "
                             "another directory, or add --force to replace it")
    if os.path.lexists(os.path.join(out, "bench.png")) and not _is_bench_json(os.path.join(out, "bench.json")):
        raise UsageError(f"--out {out!r} already holds bench.png, which triax bench did not write; choose "
                         "another directory, or add --force to replace it")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="triax bench", description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument("--nproc", default="1,2", help="process counts to run, e.g. 1,2,4 (default 1,2)")
    parser.add_argument("--out", default="bench-results", help="directory for bench.json and bench.png")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per job")
    parser.add_argument("--force", action="store_true",
                        help="replace result files in --out that triax bench did not write")
    args = parser.parse_args(argv)
    counts = parse_process_counts(args.nproc)
    check_choices(args)
    safe_files.check_output_place("--out", args.out)  # one line before any job is started
    os.makedirs(args.out, exist_ok=True)

    records = []
    for nproc in counts:
        print(f"triax bench: {args.model} on {nproc} process(es)...", flush=True)
        started = time.perf_counter()
        records.append(run_job(nproc, args, os.path.join(args.out, f"raw-{nproc}.json")))
        print(f"  done in {time.perf_counter() - started:.0f}s", flush=True)
    rows = report.summarize(records)
    print(report.format_table(rows))

    write_results(args, argv, records, rows)
    return 0


def write_results(args: argparse.Namespace, argv: list[str] | None, records: list[dict], rows: list[dict]) -> None:
    """bench.json (the table's rows and each job's raw record) and, unless --no-chart, bench.png."""
    summary = {
        "command": "triax bench " + " ".join(argv if argv is not None else sys.argv[2:]),
        "model": args.model, "precision": args.precision, "batch_size_per_process": args.batch_size,
        "block_size": args.block_size, "peak_flops": records[0]["peak_flops"],
        "peak_flops_source": records[0]["peak_flops_source"], "host": platform.node(),
        "cpu_count": os.cpu_count(), "torch": records[0]["torch"], "rows": rows, "raw": records,
    }
    json_path = os.path.join(args.out, "bench.json")
    with open(json_path, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(f"wrote {json_path}")
    if not args.no_chart:
        png_path = os.path.join(args.out, "bench.png")
        title = f"triax bench: {args.model}, batch {args.batch_size}/process, {args.precision}"
        if report.write_chart(rows, png_path, title):
            print(f"wrote {png_path}")
        else:
            print("no chart: matplotlib is not installed (pip install 'triax[bench]')")
