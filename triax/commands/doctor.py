"""`triax doctor`: is this machine, and this job's cluster, ready for the run its config describes?
(the checks: triax.doctor.readiness). `--gpu-suite` runs the GPU acceptance instead
(triax.bench.gpu_suite, with its own options and report).

Runs as one process or as every rank of a job (torchrun, `triax launch`, srun, mpirun). Exit code 1
when something a run needs failed, 0 otherwise (warnings included), 2 for a bad command line.
"""

from __future__ import annotations

import argparse

from triax.arguments import ArgumentParser, check_output_file, need, positive
from triax.doctor import report
from triax.doctor.readiness import Doctor
from triax.runtime.place import detect_place
from triax.runtime.process_group import shutdown_distributed
from triax.train.needs import run_needs
from triax.config import compose_config

SECTIONS = ("system", "compile", "memory", "storage", "network")
DEFAULT_REPORT = "triax-doctor.json"
DEFAULT_SIZES_MIB = "1,16"
MAX_SIZE_MIB = 4096  # a collective's buffer is allocated on every rank: beyond this, a typo
# Each measurement repeats for --seconds (a dozen of them): a minute each is already a long doctor.
MAX_SECONDS = 60.0
MIN_SECONDS = 0.01  # below a timer's resolution on a loaded machine: a measurement of nothing
# Reaching the rendezvous store: an hour covers a slow scheduler starting the nodes one by one.
MAX_STORE_TIMEOUT_S = 3600.0

USAGE_EPILOG = """examples:
  triax doctor
  triax doctor model=gpt2 trainer.precision=bf16 trainer.snapshot_dir=/data/snapshots
  torchrun --nnodes 4 --nproc-per-node 8 ... -m triax doctor parallel.dp_shard=8
  triax doctor --gpu-suite        # the whole GPU acceptance run (about 3 minutes on one H200)

KEY=VALUE overrides are `triax train`'s (triax train --help lists them)."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="triax doctor", epilog=USAGE_EPILOG,
                            description="Is this machine, and this job's cluster, ready for the run its config describes?",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="the run's config, as for triax train")
    parser.add_argument("--json", default=DEFAULT_REPORT, metavar="PATH",
                        help=f"where rank 0 writes the report (default {DEFAULT_REPORT})")
    parser.add_argument("--force", action="store_true", help="replace a --json file the doctor did not write")
    parser.add_argument("--skip", action="append", default=[], choices=SECTIONS,
                        help="leave out a section (repeat for several); it is listed as skipped")
    parser.add_argument("--store-timeout", type=float, default=60.0, metavar="S",
                        help="seconds every rank has to reach the rendezvous store (default 60)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES_MIB, metavar="MIB,...",
                        help=f"all-reduce/all-gather sizes over the whole job, MiB (default {DEFAULT_SIZES_MIB})")
    parser.add_argument("--link-mib", type=float, default=4.0, help="all-reduce size between two nodes, MiB")
    parser.add_argument("--seconds", type=float, default=0.5, metavar="S",
                        help="time each measurement is repeated for (default 0.5)")
    parser.add_argument("--gpu-suite", action="store_true", help="the GPU acceptance suite (its own options)")
    args = parser.parse_args(argv)
    for override in args.overrides:
        need("=" in override, "KEY=VALUE", override, "give config overrides as key=value (triax train --help)")
    positive("--store-timeout", args.store_timeout)
    need(1 <= args.store_timeout <= MAX_STORE_TIMEOUT_S, "--store-timeout", args.store_timeout,
         f"use from 1 to {MAX_STORE_TIMEOUT_S:g} seconds")
    positive("--seconds", args.seconds)
    need(MIN_SECONDS <= args.seconds <= MAX_SECONDS, "--seconds", args.seconds,
         f"each measurement is repeated for {MIN_SECONDS} to {MAX_SECONDS:g} seconds; use a number in that range")
    positive("--link-mib", args.link_mib)
    need(1 / 1024 <= args.link_mib <= MAX_SIZE_MIB, "--link-mib", args.link_mib,
         f"use from 1/1024 (1 KiB) to {MAX_SIZE_MIB}")
    args.sizes = _sizes(args.sizes)
    return args


def _sizes(text: str) -> list[int]:
    sizes = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = float("nan")
        need(value == value and 1 / 1024 <= value <= MAX_SIZE_MIB, "--sizes", text,
             f"give sizes in MiB from 1/1024 (1 KiB) to {MAX_SIZE_MIB}, separated by commas (e.g. 1,16)")
        sizes.append(int(value * 2**20))
    return sizes


def main(argv: list[str]) -> int:
    if "--gpu-suite" in argv:
        from triax.bench import gpu_suite  # deferred: torch.profiler and the trainer, only for the suite

        return int(gpu_suite.main([arg for arg in argv if arg != "--gpu-suite"]) or 0)
    args = parse(argv)
    config = compose_config(args.overrides)
    place = detect_place()
    if place.is_main:
        check_output_file("--json", args.json, args.force, report.is_doctor_report)
    try:
        return Doctor(config, args, place, run_needs).run()
    finally:
        shutdown_distributed()
