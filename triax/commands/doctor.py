"""`triax doctor`: is this machine, and this job's cluster, ready for the run its config describes?
(the checks: triax.doctor.readiness). `--gpu-suite` runs the GPU acceptance instead
(triax.bench.gpu_suite, with its own options, parsed and checked here, and its own report).

One parser for both forms: an option of the other form is refused by name, one line, as the
two forms' own parsers did. Runs as one process or as every rank of a job (torchrun, `triax
launch`, srun, mpirun). Exit code 1 when something a run needs failed, 0 otherwise (warnings
included), 2 for a bad command line.
"""

from __future__ import annotations

import argparse

from triax.arguments import ArgumentParser, FormOption, check_device, check_output_file, need, positive
from triax.doctor import report
from triax.doctor.readiness import Doctor
from triax.runtime.place import detect_place
from triax.runtime.process_group import shutdown_distributed
from triax.train.needs import run_needs
from triax.config import compose_config

SECTIONS = ("system", "compile", "memory", "storage", "network")
DEFAULT_REPORT = "triax-doctor.json"
DEFAULT_SIZES_MIB = "1,16"
GPU_SUITE_PROG = "triax doctor --gpu-suite"
MAX_SIZE_MIB = 4096  # a collective's buffer is allocated on every rank: beyond this, a typo
# Each measurement repeats for --seconds (a dozen of them): a minute each is already a long doctor.
MAX_SECONDS = 60.0
MIN_SECONDS = 0.01  # below a timer's resolution on a loaded machine: a measurement of nothing
# Reaching the rendezvous store: an hour covers a slow scheduler starting the nodes one by one.
MAX_STORE_TIMEOUT_S = 3600.0

# The options only one form takes (by destination), and each form's defaults for them.
DOCTOR_ONLY = {"store_timeout": "--store-timeout", "sizes": "--sizes", "link_mib": "--link-mib",
               "seconds": "--seconds"}
SUITE_ONLY = {"budget": "--budget", "device": "--device", "batch_cap": "--batch-cap", "no_compile": "--no-compile"}
DOCTOR_DEFAULTS = {"json": DEFAULT_REPORT, "store_timeout": 60.0, "sizes": DEFAULT_SIZES_MIB, "link_mib": 4.0,
                   "seconds": 0.5}
SUITE_DEFAULTS = {"json": "gpu-suite.json", "budget": 480.0, "batch_cap": 64, "no_compile": False}

USAGE_EPILOG = """examples:
  triax doctor
  triax doctor model=gpt2 trainer.precision=bf16 trainer.snapshot_dir=/data/snapshots
  torchrun --nnodes 4 --nproc-per-node 8 ... -m triax doctor parallel.dp_shard=8
  triax doctor --gpu-suite        # the whole GPU acceptance run (about 3 minutes on one H200)

KEY=VALUE overrides are `triax train`'s (triax train --help lists them)."""


def parser() -> ArgumentParser:
    parser = ArgumentParser(prog="triax doctor", epilog=USAGE_EPILOG,
                            description="Is this machine, and this job's cluster, ready for the run its config "
                                        "describes?", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="the run's config, as for triax train")
    parser.add_argument("--json", default=None, metavar="PATH", help=f"where rank 0 writes the report (default "
                        f"{DEFAULT_REPORT}; with --gpu-suite, {SUITE_DEFAULTS['json']})")
    parser.add_argument("--force", action="store_true", help="replace a --json file the doctor did not write")
    parser.add_argument("--skip", action="append", default=[], metavar="SECTION",
                        help=f"leave out a section (repeat for several); it is listed as skipped: "
                             f"{', '.join(SECTIONS)} (with --gpu-suite: comma-separated parts of the suite)")
    parser.add_argument("--store-timeout", type=float, default=None, metavar="S",
                        help="seconds every rank has to reach the rendezvous store (default 60)")
    parser.add_argument("--sizes", default=None, metavar="MIB,...",
                        help=f"all-reduce/all-gather sizes over the whole job, MiB (default {DEFAULT_SIZES_MIB})")
    parser.add_argument("--link-mib", type=float, default=None, help="all-reduce size between two nodes, MiB")
    parser.add_argument("--seconds", type=float, default=None, metavar="S",
                        help="time each measurement is repeated for (default 0.5)")
    # Once read, errors name `triax doctor --gpu-suite`, as the suite's own parser did.
    parser.add_argument("--gpu-suite", action=FormOption, switch=True, form=GPU_SUITE_PROG,
                        help="the GPU acceptance suite (its own options, below)")
    suite = parser.add_argument_group("--gpu-suite options", "the GPU acceptance in one command: gpu tests, "
                                      "matmul rate,\nthroughput and MFU against a hand-written loop, largest "
                                      "batch, snapshot cost;\none JSON report")
    suite.add_argument("--budget", type=float, default=None, help=f"seconds for the whole suite; each part gets "
                       f"its share (default: {SUITE_DEFAULTS['budget']})")
    suite.add_argument("--device", default=None, help="cuda:N to use (default: cuda if visible, else cpu)")
    suite.add_argument("--batch-cap", type=int, default=None,
                       help=f"the largest micro-batch tried (default: {SUITE_DEFAULTS['batch_cap']})")
    suite.add_argument("--no-compile", action="store_const", const=True, default=None,
                       help="time the models uncompiled (torch.compile's first compilation takes minutes on a CPU)")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    command = parser()
    args = command.parse_args(argv)
    foreign = DOCTOR_ONLY if args.gpu_suite else SUITE_ONLY
    given = {option for dest, option in foreign.items() if getattr(args, dest) is not None}
    for word in argv:  # the first in the order given, as the form's own parser named it
        if word.split("=", 1)[0] in given:
            command.error(f"unrecognized arguments: {word}")
    if args.gpu_suite:
        if args.overrides:
            command.error(f"unrecognized arguments: {' '.join(args.overrides)}")
        return _suite_arguments(args, command)
    return _doctor_arguments(args, command)


def _doctor_arguments(args: argparse.Namespace, command: ArgumentParser) -> argparse.Namespace:
    for dest, default in DOCTOR_DEFAULTS.items():
        setattr(args, dest, default if getattr(args, dest) is None else getattr(args, dest))
    for section in args.skip:
        if section not in SECTIONS:
            command.error(f"argument --skip: invalid choice: {section!r} (choose from "
                          f"{', '.join(repr(name) for name in SECTIONS)})")
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


def _suite_arguments(args: argparse.Namespace, command: ArgumentParser) -> argparse.Namespace:
    """The suite's options, checked as its own parser checked them (one line each)."""
    import torch  # deferred: the CLI checks its options (and OMP_NUM_THREADS) before torch loads

    from triax.bench import gpu_suite  # deferred: torch.profiler and the trainer, only for the suite

    for dest, default in SUITE_DEFAULTS.items():
        setattr(args, dest, default if getattr(args, dest) is None else getattr(args, dest))
    args.skip = args.skip[-1] if args.skip else ""  # one comma-separated list, the last given
    if not (0 < args.budget <= 7200):
        command.error(f"--budget {args.budget:g}: give seconds between 1 and 7200")
    if args.batch_cap < 1 or args.batch_cap > 4096:
        command.error(f"--batch-cap {args.batch_cap}: give a number from 1 to 4096")
    unknown = sorted(set(filter(None, args.skip.split(","))) - set(gpu_suite.SHARES))
    if unknown:
        command.error(f"--skip {args.skip!r}: unknown part(s) {', '.join(unknown)}; parts are "
                      f"{', '.join(gpu_suite.SHARES)}")
    if args.device is not None:
        check_device("--device", args.device, allow_auto=False)
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            command.error(f"--device {args.device}: CUDA is not available on this machine; leave --device out")
        index = torch.device(args.device).index
        if index is not None and index >= torch.cuda.device_count():
            command.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA devices")
    # The one output rule of triax's reports: a new file, or one this suite wrote; never a link's target.
    check_output_file("--json", args.json, args.force, gpu_suite.is_suite_report)
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
    args = parse(argv)
    if args.gpu_suite:
        from triax.bench import gpu_suite  # deferred: as in _suite_arguments

        return gpu_suite.run(args)
    config = compose_config(args.overrides)
    place = detect_place()
    if place.is_main:
        check_output_file("--json", args.json, args.force, report.is_doctor_report)
    try:
        return Doctor(config, args, place, run_needs).run()
    finally:
        shutdown_distributed()
