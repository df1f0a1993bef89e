"""`triax horovodrun`: Horovod's launcher command line, carried out by torchrun.

    triax horovodrun -np 4 python train.py
    triax horovodrun -np 8 -H node1:4,node2:4 python train.py

One host: a single torchrun with --nproc-per-node. Several hosts: one torchrun per host, started
over ssh as horovodrun does, with the first host as the rendezvous address. `--dry-run` prints the
commands instead of running them.

Remote starts are built so no host, option or value can be read as something else: host names
are validated (none may start with '-') and follow `--` in ssh's argv; every remote word is
quoted; forwarded environment values travel on ssh's stdin, not on any command line (where `ps`
would show them); host-key checking is left to the user's ssh configuration (`--ssh-option` passes
options through). If one host's processes fail, the others are stopped and the failing host is named.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

from triax import safe_files
from triax.errors import TriaxError
from triax.rendezvous import free_port

_LOCAL_NAMES = {"localhost", "127.0.0.1", socket.gethostname()}
# Variables handed to remote hosts (horovodrun forwards the environment the same way).
_FORWARDED_PREFIXES = ("HOROVOD_", "TRIAX_", "NCCL_", "PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
# A host: a name or address (optionally user@), or a bracketed IPv6 address; never an option.
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?(?:[A-Za-z0-9_][A-Za-z0-9_.%-]*|\[[0-9A-Fa-f:.%]+\])$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The remote shell reads the environment and the command from stdin, so neither is on a command line.
_REMOTE_SHELL = "sh -c 'eval \"$(cat)\"'"
_STOP_GRACE_S = 10.0


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port in 1..65535")
    return port


def _count(minimum: int):
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} must be at least {minimum}")
        return number
    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, through the CLI's TriaxError handling
        raise TriaxError(f"horovodrun: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="triax horovodrun",
                                     description="horovodrun-compatible launcher on torchrun")
    parser.add_argument("-np", "--num-proc", dest="np", type=_count(1), help="total number of processes")
    parser.add_argument("-H", "--hosts", help="host:slots,... (default localhost:NP)")
    parser.add_argument("-hostfile", "--hostfile", help="file with 'host slots=N' lines")
    parser.add_argument("-p", "--ssh-port", type=_port, help="ssh port for remote hosts")
    parser.add_argument("-i", "--ssh-identity-file", help="ssh identity file for remote hosts")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="OPTION",
                        help="passed to ssh as -o OPTION (repeatable), e.g. StrictHostKeyChecking=accept-new")
    parser.add_argument("--start-timeout", type=_count(0), help=argparse.SUPPRESS)  # torchrun waits on its own
    parser.add_argument("--reset-limit", type=_count(0), default=0, help="restarts allowed (torchrun --max-restarts)")
    parser.add_argument("--master-port", type=_port, help="rendezvous port (default: a free one)")
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


def _entry(host: str, slots: str, where: str) -> tuple[str, int]:
    if not _HOST.match(host):
        raise TriaxError(f"{where}: {host!r} is not a host name (letters, digits, '.', '-', '_', optional "
                         "user@; it may not start with '-')")
    try:
        count = int(slots)
    except ValueError:
        raise TriaxError(f"{where}: slots={slots!r} is not a whole number; e.g. {host}:4") from None
    if count < 1:
        raise TriaxError(f"{where}: slots={count} must be at least 1")
    return host, count


MAX_HOSTFILE_BYTES = 1 << 20  # one 'host slots=N' line per host: far more hosts than any job


def parse_hosts(hosts: str | None, hostfile: str | None, np: int | None) -> list[tuple[str, int]]:
    if hosts and hostfile:
        raise TriaxError("pass either -H or --hostfile, not both")
    entries: list[tuple[str, int]] = []
    if hostfile:
        try:
            # A regular file of at most 1 MiB, opened without blocking: a FIFO is refused instead of
            # waited on. The path is the user's own argument, so a link they name is followed.
            lines = safe_files.read_text(os.path.realpath(hostfile), MAX_HOSTFILE_BYTES).splitlines()
        except OSError as error:
            raise TriaxError(f"cannot read the hostfile {hostfile}: {error.strerror or error}") from None
        except UnicodeDecodeError:
            raise TriaxError(f"the hostfile {hostfile} is not text; write one 'host slots=N' per line") from None
        for number, line in enumerate(lines, 1):
            words = line.split("#")[0].split()
            if not words:
                continue
            slots = "1"
            for word in words[1:]:
                key, _, value = word.partition("=")
                if key != "slots" or not value:
                    raise TriaxError(f"{hostfile}:{number}: {word!r} is not slots=N; write 'host slots=N'")
                slots = value
            entries.append(_entry(words[0], slots, f"{hostfile}:{number}"))
        if not entries:
            raise TriaxError(f"the hostfile {hostfile} lists no hosts; write one 'host slots=N' per line")
    elif hosts:
        for item in hosts.split(","):
            name, colon, slots = item.strip().rpartition(":")
            if not colon or name.endswith(":"):  # no slots given (or a bare IPv6 address)
                name, slots = item.strip(), "1"
            entries.append(_entry(name, slots, f"-H entry {item!r}"))
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
    master = "127.0.0.1" if len(placed) == 1 else placed[0][0].rpartition("@")[2].strip("[]")
    if len(placed) > 1 and master in _LOCAL_NAMES:
        master = socket.getfqdn()  # "localhost" would point each remote host at itself
    commands = []
    slots = ",".join(str(procs) for _, procs in placed)
    for node_rank, (host, procs) in enumerate(placed):
        # Each worker starts through worker_env, which sets Horovod's HOROVOD_* variables first.
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(placed)}",
                f"--node-rank={node_rank}", f"--nproc-per-node={procs}", f"--master-addr={master}",
                f"--master-port={port}", f"--max-restarts={restarts}", "--no-python",
                sys.executable, "-m", "triax.horovod.worker_env", f"--slots={slots}", f"--hostname={host}",
                "--", *command]
        commands.append((host, argv))
    return commands


def _forwarded_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES) and _ENV_NAME.match(k)}


def remote_start(host: str, argv: list[str], args) -> tuple[list[str], str]:
    """(ssh argv, script for its stdin). The script sets the environment and runs the command."""
    ssh = ["ssh"]
    for option in args.ssh_option:
        ssh += ["-o", option]
    if args.ssh_port:
        ssh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        ssh += ["-i", args.ssh_identity_file]
    user, at, name = host.rpartition("@")
    ssh += ["--", user + at + name.strip("[]"), _REMOTE_SHELL]  # ssh takes IPv6 addresses bare
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in _forwarded_environment().items())
    script = f"cd {shlex.quote(os.getcwd())} || exit 1\n{exports}exec {shlex.join(argv)}\n"
    return ssh, script


def _start(host: str, argv: list[str], script: str | None) -> subprocess.Popen:
    # A session of its own: stopping it stops torchrun and every worker it started.
    process = subprocess.Popen(argv, stdin=subprocess.PIPE if script is not None else None, start_new_session=True)
    if script is not None:
        process.stdin.write(script.encode())
        process.stdin.close()
    return process


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM every process group still running, then SIGKILL what outlives the grace period."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def supervise(hosts: list[str], processes: list[subprocess.Popen]) -> int:
    """Wait for every host; the first failure stops the others. Returns the failing exit code."""
    try:
        while True:
            codes = [process.poll() for process in processes]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                first = failed[0]
                others = [hosts[i] for i, code in enumerate(codes) if code is None]
                print(f"triax horovodrun: host {hosts[first]} (node {first}) exited with code {codes[first]}"
                      + (f"; stopping {', '.join(others)}" if others else ""), file=sys.stderr, flush=True)
                _stop(processes)
                return codes[first]
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(processes)
        raise


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
    placed = place_processes(entries, np)
    if args.gloo_timeout_seconds is not None:
        from triax.timeouts import collective_timeout

        # Exported before the workers start: local ones inherit it, remote ones get HOROVOD_* forwarded.
        seconds = collective_timeout(args.gloo_timeout_seconds, "--gloo-timeout-seconds")
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = f"{seconds:g}"
    port = args.master_port or free_port()
    commands = torchrun_commands(placed, command, port, args.reset_limit)
    launches = []
    for host, torchrun in commands:
        if host in _LOCAL_NAMES:
            launches.append((host, torchrun, None))
        else:
            ssh, script = remote_start(host, torchrun, args)
            launches.append((host, ssh, script))
    if args.dry_run or args.verbose:
        for host, command_argv, script in launches:
            line = f"[{host}] {shlex.join(command_argv)}"
            if script is not None:
                names = sorted(_forwarded_environment())
                line += f"  <<< cd + {len(names)} variable(s) on stdin ({', '.join(names) or 'none'}), then: " \
                        f"{script.strip().splitlines()[-1]}"
            print(line, flush=True)
        if args.dry_run:
            return 0
    processes = []
    try:
        for host, command_argv, script in launches:
            processes.append(_start(host, command_argv, script))
    except OSError as error:
        _stop(processes)
        raise TriaxError(f"cannot start {command_argv[0]}: {error.strerror or error}") from None
    return supervise([host for host, _, _ in launches], processes)
