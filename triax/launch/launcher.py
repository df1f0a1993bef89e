"""`triax launch`: start a script (or `-m module`) on many processes through torchrun.

This is a front end to torch.distributed.run, not a replacement: it fills torchrun's options
from the config file written by `triax config` (overridden by the command line), checks the
rendezvous port before any worker starts, binds single-machine runs to loopback, hands the
Accelerator its settings through environment variables, and then calls torchrun in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import math
import shlex
import signal
import socket
import sys

from triax.launch import slurm
from triax.arguments import ArgumentParser, check_script
from triax.errors import TriaxError, UsageError
from triax.launch import settings, variables, workers
from triax.launch.accelerate_config import FSDP_FLAGS, fsdp_flags_environment
from triax.launch.config import (
    RDZV_BACKENDS,
    LaunchConfig,
    config_path,
    default_config,
    read_config_file,
)



def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="triax launch", usage="triax launch [options] (script.py | -m module) [args...]",
        description="Start a training script on several processes (a front end to torchrun). "
                    "Options default to the file written by `triax config`.")

    def option(name: str, **kwargs):
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


def resolve_config(args) -> tuple[LaunchConfig, dict[str, str]]:
    """Command line over config file over built-in defaults; with the environment the file asks
    for the workers (an Accelerate config's FSDP section)."""
    path = args.config_file or config_path()
    if args.config_file and not os.path.exists(path):
        raise TriaxError(f"--config-file {path} does not exist; run `triax config --config-file {path}` first")
    config, environment = read_config_file(path) or (default_config(), {})
    # Inside an srun step, Slurm says how many machines there are and which one this is; the
    # command line still wins, and must then agree with the step.
    placement = slurm.launch_placement(os.environ)
    config = dataclasses.replace(config, **placement)
    overrides = {field.name: getattr(args, field.name, None) for field in dataclasses.fields(LaunchConfig)}
    overrides["use_cpu"] = args.cpu
    flags = {key: getattr(args, key) for key in FSDP_FLAGS if getattr(args, key) is not None}
    if args.use_fsdp:
        if overrides["parallel"] not in (None, "fsdp"):
            raise UsageError(f"--use_fsdp asks for FSDP but --parallel is {overrides['parallel']}; pass one of them")
        environment = fsdp_flags_environment(flags, environment)
        overrides["parallel"] = "fsdp"
    elif flags:
        if "ACCELERATE_USE_FSDP" not in environment:
            raise UsageError(f"--{next(iter(flags))} is an FSDP option, but FSDP is not asked for; add --use_fsdp "
                             "(or use an Accelerate config file with distributed_type: FSDP)")
        environment = fsdp_flags_environment(flags, environment)
    if overrides["parallel"] is None and os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes"):
        # The FSDP environment of `accelerate launch --use_fsdp`, set by hand: the workers
        # inherit its FSDP_* variables, and their Accelerator builds its plugin from them.
        overrides["parallel"] = "fsdp"
    config = dataclasses.replace(config, **{key: value for key, value in overrides.items() if value is not None})
    if placement and config.num_machines != placement["num_machines"]:
        raise TriaxError(f"triax launch was asked for {config.num_machines} machines but this srun step runs on "
                         f"{placement['num_machines']} node(s) ({os.environ.get('SLURM_STEP_NODELIST', '?')}); "
                         f"ask Slurm for {config.num_machines} nodes (sbatch --nodes) or drop --num-machines")
    return config.validate("triax launch"), environment


def _port_is_free(port: int) -> bool:
    # torchrun's TCPStore listens on every interface, so check the wildcard address: it also
    # collides with a process that holds only the loopback address.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def check_port(config: LaunchConfig, dry_run: bool = False) -> LaunchConfig:
    """Pick a free port for 0; refuse a busy one before any worker starts (on machine 0, which
    hosts the rendezvous). A dry run starts nothing, so whether the port is busy now says nothing
    about when its command runs."""
    if config.main_process_port == 0:
        if config.num_machines > 1:
            raise TriaxError("--main-process-port 0 (pick a free port) only works on one machine: the "
                             "other machines must know the port; give a fixed port such as 29500")
        from triax.runtime.rendezvous import free_port

        return dataclasses.replace(config, main_process_port=free_port())
    if config.machine_rank == 0 and not dry_run and not _port_is_free(config.main_process_port):
        raise TriaxError(f"rendezvous port {config.main_process_port} is already in use on this machine "
                         "(another training job?); pass --main-process-port 0 to pick a free port, "
                         "or another port number")
    return config


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name in ("lo", "lo0")), None)


def torchrun_argv(config: LaunchConfig, script: str, script_args: list[str], module: bool,
                  rdzv_conf: str | None = None) -> list[str]:
    argv = [f"--nnodes={config.num_machines}", f"--nproc-per-node={config.num_processes}",
            f"--max-restarts={config.max_restarts}"]
    if config.rdzv_backend == "static":
        argv += [f"--node-rank={config.machine_rank}", f"--master-addr={config.main_process_ip}",
                 f"--master-port={config.main_process_port}"]
    else:
        argv += [f"--rdzv-backend={config.rdzv_backend}",
                 f"--rdzv-endpoint={config.main_process_ip}:{config.main_process_port}",
                 f"--rdzv-id={config.rdzv_id}"]
        if config.num_machines == 1:
            argv.append("--local-addr=127.0.0.1")
    if rdzv_conf:
        argv.append(f"--rdzv-conf={rdzv_conf}")
    if module:
        argv.append("--module")
    return argv + [script, *script_args]


def loopback_store(config: LaunchConfig):
    """On one machine, the rendezvous store listening on loopback only; None on several machines.

    torchrun's agent hosts a TCPStore (unauthenticated: anyone who reaches it can read and write the
    job's keys), and a TCPStore's server listens on every interface whatever address it is given.
    A store created first in this process on a socket bound to 127.0.0.1 (`master_listen_fd`), as
    multi-tenant, is the server torchrun's own multi-tenant store for that port then uses: keep the
    returned store alive while torchrun runs."""
    if config.num_machines != 1:
        return None
    from triax.runtime.rendezvous import loopback_store as store_on_loopback  # deferred: it imports torch

    return store_on_loopback(config.main_process_port, 60, multi_tenant=True)


def child_environment(config: LaunchConfig) -> dict[str, str]:
    """Variables torchrun's workers inherit: the Accelerator's settings, and loopback for
    single-machine collectives (no reliance on the hostname resolving to a reachable address)."""
    env = settings.to_environment(config)
    env[settings.ERRORS_REPORTED_BY_LAUNCHER_ENV] = "1"
    if config.num_machines == 1:
        loopback = _loopback_interface()
        if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = loopback
    return env


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
        from triax.runtime.timeouts import ENV_COLLECTIVE_TIMEOUT, collective_timeout

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
    os.environ.update(env)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    from torch.distributed.elastic.multiprocessing import SignalException  # deferred: torch, only when workers start

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
        print(f"triax launch: {args.script} failed on {failures}; its output is above", file=sys.stderr)
        return 1
    finally:
        workers.restore(previous)
    return 0
