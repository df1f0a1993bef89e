"""`triax launch`: start a script (or `-m module`) on many processes through torchrun.

This is a front end to torch.distributed.run, not a replacement: it fills torchrun's options
from the config file written by `triax config` (overridden by the command line), checks the
rendezvous port before any worker starts, binds single-machine runs to loopback, hands the
Accelerator its settings through environment variables, and then calls torchrun in-process
(the pieces: triax.launch.launcher).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import signal
import sys

from triax.arguments import ArgumentParser, check_script
from triax.errors import UsageError
from triax.launch import settings, variables, workers
from triax.launch.accelerate_config import FSDP_FLAGS
from triax.launch.config import RDZV_BACKENDS, LaunchConfig
from triax.launch.launcher import check_port, child_environment, loopback_store, resolve_config, torchrun_argv
from triax.runtime.timeouts import ENV_COLLECTIVE_TIMEOUT, collective_timeout


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="triax launch", usage="triax launch [options] (script.py | -m module) [args...]",
        description="Start a training script on several processes (a front end to torchrun). "
                    "Options default to the file written by `triax config`.")

    def option(name: str, **kwargs: object) -> None:
        # Accept Accelerate's underscore spelling too (--num_processes), so its users' muscle
        # memory works.
        spellings = [f"--{name}"] + ([f"--{name.replace('-', '_')}"] if "-" in name else [])
        parser.add_argument(*spellings, dest=name.replace("-", "_"), default=None, **kwargs)

    option("config-file", help="launch configuration to read (default: $TRIAX_CONFIG_FILE or the cache dir)")
    option("num-processes", type=int, help="processes per machine")
    option("num-machines", type=int, help="machines in the job")
    option("machine-rank", type=int, help="this machine's rank (0 hosts the rendezvous)")
    option("main-process-ip", help="address of machine 0")
    option("main-process-port", type=int, help="rendezvous port on machine 0; 0 picks a free one")
    option("mixed-precision", choices=settings.MIXED_PRECISION_CHOICES, help="passed to the Accelerator")
    option("parallel", choices=settings.PARALLEL_CHOICES, help="passed to the Accelerator")
    option("gradient-accumulation-steps", type=int, help="passed to the Accelerator")
    option("max-restarts", type=int, help="restarts of all workers after a failure (torchrun)")
    option("rdzv-backend", choices=RDZV_BACKENDS, help="torchrun rendezvous backend")
    option("rdzv-id", help="job id for an elastic (c10d/etcd) rendezvous")
    option("rdzv-conf", help="extra rendezvous settings, key=value,... (torchrun --rdzv-conf)")
    option("collective-timeout", type=float,
           help="seconds a collective may wait before the job fails with a message (default: 600 for "
                "the process group; `triax train` steps: 120, see trainer.collective_timeout)")
    option("grad-compression", choices=("none", "bf16", "fp16", "powersgd"),
                        help="DDP gradient compression for a plain DDP script, script untouched (triax.ddp_boost)")
    option("bucket-cap-mb", type=float, help="DDP bucket size for the script's DDP models (triax.ddp_boost)")
    parser.add_argument("--use_fsdp", "--use-fsdp", action="store_true", default=None,
                        help="FSDP for the Accelerator, set as accelerate launch sets it (with the --fsdp_* options)")
    for key in FSDP_FLAGS:
        option(key.replace("_", "-"), metavar="VALUE", help=f"with --use_fsdp: accelerate launch's --{key}")
    parser.add_argument("--cpu", action="store_true", default=None, help="train on the CPU only")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the target as a Python module (python -m)")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    parser.add_argument("script", help="training script (or module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def check_rdzv_conf(text: str | None) -> None:
    if text is None:
        return
    for item in text.split(","):
        key, equals, value = item.partition("=")
        if not equals or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv-conf {text!r} is invalid; write key=value pairs separated by commas, "
                             "e.g. join_timeout=600,read_timeout=60")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_rdzv_conf(args.rdzv_conf)
    if args.bucket_cap_mb is not None and not (math.isfinite(args.bucket_cap_mb) and args.bucket_cap_mb > 0):
        raise UsageError(f"--bucket-cap-mb {args.bucket_cap_mb} is invalid; use a positive size in MB (DDP's default: 25)")
    config, file_environment = resolve_config(args)
    # What the workers' Accelerators will read: the file's and the options' values (checked under
    # their own names already) over the FSDP_*/ACCELERATE_* variables this shell passes on.
    variables.check_environment({**os.environ, **file_environment})
    if not args.dry_run:  # a dry run only prints the command: its script may live on another machine
        check_script(args.script, args.module)
    if config.num_machines == 1 and config.main_process_ip not in ("127.0.0.1", "localhost", "::1"):
        # One machine: everything stays on loopback, whatever the config says.
        config = dataclasses.replace(config, main_process_ip="127.0.0.1")
    config = check_port(config, args.dry_run)
    script, script_args, module = args.script, args.script_args, args.module
    env = {**file_environment, **child_environment(config)}
    if args.collective_timeout is not None:
        env[ENV_COLLECTIVE_TIMEOUT] = f"{collective_timeout(args.collective_timeout, '--collective-timeout'):g}"
    if args.grad_compression or args.bucket_cap_mb:
        # Every worker runs the script through triax.ddp_boost, which hooks its DDP models.
        script_args = (["-m", script] if module else [script]) + script_args
        script, module = "triax.ddp_boost", True
        env[settings.GRAD_COMPRESSION_ENV] = args.grad_compression or "none"
        if args.bucket_cap_mb:
            env[settings.DDP_BUCKET_CAP_MB_ENV] = str(args.bucket_cap_mb)
    run_argv = torchrun_argv(config, script, script_args, module, args.rdzv_conf)
    if args.dry_run:
        prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
        print(f"{prefix} {shlex.quote(sys.executable)} -m torch.distributed.run {shlex.join(run_argv)}")
        return 0
    return start_workers(config, env, run_argv, args.script)


def start_workers(config: LaunchConfig, env: dict[str, str], run_argv: list[str], script: str) -> int:
    """torchrun, in this process, with the workers' environment; its outcome as an exit code."""
    os.environ.update(env)
    # deferred: torch, only when workers start
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # deferred: as above
    from torch.distributed.run import parse_args, run  # deferred: as above

    store = loopback_store(config)  # noqa: F841 - held while torchrun runs
    before = workers.snapshot()
    previous = workers.forward_signals(before)
    try:
        run(parse_args(run_argv))
    except SignalException as error:
        # torchrun's agent was told to stop (scancel, a preemption): it passed the signal on and
        # waited for the workers. The job ended as the workers did, not as a failure of the agent.
        codes = workers.exit_codes(before)
        name = signal.Signals(error.sigval).name
        if codes and all(code == 0 for code in codes):
            print(f"triax launch: stopped by {name}; all {len(codes)} workers exited 0", file=sys.stderr)
            return 0
        print(f"triax launch: stopped by {name}; worker exit codes {codes}", file=sys.stderr)
        return 128 + int(error.sigval)
    except ChildFailedError as error:
        _, first = error.get_first_failure()
        message = first.message.get("message") if isinstance(first.message, dict) else first.message
        if first.exitcode == 2 and isinstance(message, str) and message.startswith("triax: error:"):
            # A triax command's one-line error (triax.commands.cli.report_error): once, last, and its exit code.
            print(message, file=sys.stderr)
            return 2
        failures = ", ".join(f"rank {global_rank} (exit code {failure.exitcode})"
                             for global_rank, failure in error.failures.items())
        print(f"triax launch: {script} failed on {failures}; its output is above", file=sys.stderr)
        return 1
    finally:
        workers.restore(previous)
    return 0
