"""`triax horovodrun`: Horovod's launcher command line, carried out by torchrun.

    triax horovodrun -np 4 python train.py
    triax horovodrun -np 8 -H node1:4,node2:4 python train.py

One host: a single torchrun with --nproc-per-node. Several hosts: one torchrun per host, started
over ssh as horovodrun does, with the first host as the rendezvous address. `--dry-run` prints the
commands instead of running them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys

from triax.errors import TriaxError
from triax.testing import free_port

_LOCAL_NAMES = {"localhost", "127.0.0.1", socket.gethostname()}
# Variables handed to remote hosts (horovodrun forwards the environment the same way).
_FORWARDED_PREFIXES = ("HOROVOD_", "TRIAX_", "NCCL_", "PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triax horovodrun",
                                     description="horovodrun-compatible launcher on torchrun")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, help="total number of processes")
    parser.add_argument("-H", "--hosts", help="host:slots,... (default localhost:NP)")
    parser.add_argument("-hostfile", "--hostfile", help="file with 'host slots=N' lines")
    parser.add_argument("-p", "--ssh-port", type=int, help="ssh port for remote hosts")
    parser.add_argument("--start-timeout", type=int, help=argparse.SUPPRESS)  # torchrun waits on its own
    parser.add_argument("--reset-limit", type=int, default=0, help="restarts allowed (torchrun --max-restarts)")
    parser.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    parser.add_argument("--gloo-timeout-seconds", type=float,
                        help="seconds a collective may wait before failing (HOROVOD_GLOO_TIMEOUT_SECONDS)")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command(s) and exit")
    parser.add_argument("--verbose", action="store_true")
    # Accepted so existing command lines keep working; they select engines triax does not have.
    for flag in ("--gloo", "--mpi", "--jsrun", "--tcp", "--disable-cache", "--timeline-mark-cycles",
                 "--autotune", "--no-stall-check", "--log-with-timestamp"):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for option in ("--network-interface", "--output-filename", "--timeline-filename", "--log-level",
                   "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity", "--mpi-args",
                   "--config-file"):
        parser.add_argument(option, help=argparse.SUPPRESS)
    for option in ("--min-np", "--max-np", "--host-discovery-script", "--slots-per-host"):
        parser.add_argument(option, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    return parser


def parse_hosts(hosts: str | None, hostfile: str | None, np: int | None) -> list[tuple[str, int]]:
    if hosts and hostfile:
        raise TriaxError("pass either -H or --hostfile, not both")
    entries: list[tuple[str, int]] = []
    if hostfile:
        with open(hostfile) as handle:
            for line in handle:
                line = line.split("#")[0].strip()
                if not line:
                    continue
                parts = line.split()
                slots = 1
                for part in parts[1:]:
                    if part.startswith("slots="):
                        slots = int(part.split("=", 1)[1])
                entries.append((parts[0], slots))
    elif hosts:
        for item in hosts.split(","):
            name, _, slots = item.strip().partition(":")
            try:
                entries.append((name, int(slots) if slots else 1))
            except ValueError:
                raise TriaxError(f"-H entry {item!r} is not host:slots (e.g. node1:4)") from None
    else:
        entries = [("localhost", np or 1)]
    return entries


def place_processes(entries: list[tuple[str, int]], np: int) -> list[tuple[str, int]]:
    """Fill hosts in order, as horovodrun does: (host, processes on it), hosts with none dropped."""
    total = sum(slots for _, slots in entries)
    if np > total:
        raise TriaxError(f"-np {np} asks for more processes than the {total} slots in the host list; "
                         "add hosts or slots, or lower -np")
    placed, left = [], np
    for host, slots in entries:
        if left == 0:
            break
        take = min(slots, left)
        placed.append((host, take))
        left -= take
    return placed


def torchrun_commands(placed, command, port, restarts) -> list[tuple[str, list[str]]]:
    master = "127.0.0.1" if len(placed) == 1 else placed[0][0]
    if len(placed) > 1 and master in _LOCAL_NAMES:
        master = socket.getfqdn()  # "localhost" would point each remote host at itself
    commands = []
    for node_rank, (host, procs) in enumerate(placed):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(placed)}",
                f"--node-rank={node_rank}", f"--nproc-per-node={procs}", f"--master-addr={master}",
                f"--master-port={port}", f"--max-restarts={restarts}", "--no-python", *command]
        commands.append((host, argv))
    return commands


def _remote(host: str, argv: list[str], ssh_port: int | None) -> list[str]:
    forwarded = [f"{k}={shlex.quote(v)}" for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)]
    remote = f"cd {shlex.quote(os.getcwd())} && env {' '.join(forwarded)} {shlex.join(argv)}"
    ssh = ["ssh", "-o", "StrictHostKeyChecking=no"] + (["-p", str(ssh_port)] if ssh_port else [])
    return ssh + [host, remote]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.min_np or args.max_np or args.host_discovery_script:
        raise TriaxError("elastic horovodrun options (--min-np, --max-np, --host-discovery-script) are "
                         "not mapped; run torchrun --nnodes=MIN:MAX --max-restarts=N with "
                         "--rdzv-backend=c10d on each node, and use hvd.elastic in the script")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise TriaxError("no training command given; e.g. triax horovodrun -np 2 python train.py")
    entries = parse_hosts(args.hosts, args.hostfile, args.np)
    np = args.np if args.np is not None else sum(slots for _, slots in entries)
    if np < 1:
        raise TriaxError(f"-np {np} must be at least 1")
    placed = place_processes(entries, np)
    if args.gloo_timeout_seconds is not None:
        from triax.watchdog import collective_timeout

        # Exported before the workers start: local ones inherit it, remote ones get HOROVOD_* forwarded.
        seconds = collective_timeout(args.gloo_timeout_seconds, "--gloo-timeout-seconds")
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = f"{seconds:g}"
    port = args.master_port or free_port()
    commands = torchrun_commands(placed, command, port, args.reset_limit)
    launches = [(host, argv if host in _LOCAL_NAMES else _remote(host, argv, args.ssh_port))
                for host, argv in commands]
    if args.dry_run or args.verbose:
        for host, argv in launches:
            print(f"[{host}] {shlex.join(argv)}", flush=True)
        if args.dry_run:
            return 0
    processes = [subprocess.Popen(argv) for _, argv in launches]
    codes = [process.wait() for process in processes]
    return max(codes, key=abs)
