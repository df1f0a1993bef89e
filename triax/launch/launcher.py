"""Starting a script (or `-m module`) on many processes through torchrun, for `triax launch`
(triax.commands.launch).

This is a front end to torch.distributed.run, not a replacement: it fills torchrun's options
from the config file written by `triax config` (overridden by the command line), checks the
rendezvous port before any worker starts, binds single-machine runs to loopback, hands the
Accelerator its settings through environment variables, and then calls torchrun in-process.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket

from triax.runtime import slurm
from triax.errors import TriaxError, UsageError
from triax.launch import settings
from triax.launch.accelerate_config import FSDP_FLAGS, fsdp_flags_environment
from triax.launch.config import (
    LaunchConfig,
    config_path,
    default_config,
    read_config_file,
)


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
