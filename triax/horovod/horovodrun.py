"""`triax horovodrun`: Horovod's launcher command line.

    triax horovodrun -np 4 python train.py
    triax horovodrun -np 8 -H node1:4,node2:4 python train.py
    triax horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh python train.py

A fixed job is carried out by torchrun: one torchrun with --nproc-per-node on one host; on several
hosts one torchrun per host, started over ssh as horovodrun does (processes.py), with the first host
as the rendezvous address. If one host's processes fail, the others are stopped and the failing
host is named. An elastic job (`--host-discovery-script` or `--min-np`, as Horovod decides) is run
by triax's elastic driver (elastic/driver.py). `--dry-run` prints the commands instead of running them.
Every option is checked before anything starts; a bad one is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import time

from triax.errors import TriaxError
from triax.horovod import processes
from triax.horovod.elastic import discovery
from triax.horovod.elastic.driver import ElasticSettings, run_elastic
from triax.horovod.elastic.protocol import DEFAULT_ELASTIC_TIMEOUT_S, TIMEOUT_ENV
from triax.horovod.hosts import LOCAL_NAMES, address_of, parse_hosts, place_processes
from triax.rendezvous import free_port
from triax.timeouts import collective_timeout

# Horovod's bounds for --blacklist-cooldown-range (seconds)
COOLDOWN_LOWEST_S, COOLDOWN_HIGHEST_S = 1, 3600
ELASTIC_ONLY = {"max_np": "--max-np", "slots": "--slots-per-host", "cooldown_range": "--blacklist-cooldown-range",
                "elastic_timeout": "--elastic-timeout"}


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
    parser = _Parser(prog="triax horovodrun", description="horovodrun-compatible launcher")
    parser.add_argument("-np", "--num-proc", dest="np", type=_count(1), help="total number of processes "
                        "(elastic: the number to start with)")
    parser.add_argument("-H", "--hosts", help="host:slots,... (default localhost:NP)")
    parser.add_argument("-hostfile", "--hostfile", help="file with 'host slots=N' lines")
    parser.add_argument("-p", "--ssh-port", type=_port, help="ssh port for remote hosts")
    parser.add_argument("-i", "--ssh-identity-file", help="ssh identity file for remote hosts")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="OPTION",
                        help="passed to ssh as -o OPTION (repeatable), e.g. StrictHostKeyChecking=accept-new")
    parser.add_argument("--start-timeout", type=_count(0), help=argparse.SUPPRESS)  # torchrun waits on its own
    parser.add_argument("--reset-limit", type=_count(0), help="elastic: resets allowed (default: no limit); "
                        "fixed: restarts allowed (torchrun --max-restarts, default 0)")
    parser.add_argument("--master-port", type=_port, help="rendezvous port (default: a free one)")
    parser.add_argument("--gloo-timeout-seconds", type=float,
                        help="seconds a collective may wait before failing (HOROVOD_GLOO_TIMEOUT_SECONDS)")
    parser.add_argument("--network-interface", help="the interface(s) collectives use, e.g. eth0 (GLOO_SOCKET_IFNAME)")
    elastic = parser.add_argument_group("elastic")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_count(1),
                         help="fewest processes to keep training with (makes the job elastic)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_count(1), help="most processes to run")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots", type=_count(1),
                         help="slots of a host the discovery script lists without ':slots'")
    elastic.add_argument("--host-discovery-script", help="prints the available hosts, one 'host[:slots]' a line "
                         "(makes the job elastic)")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", nargs=2, type=_count(0),
                         metavar=("MIN_S", "MAX_S"), help="seconds a failing host stays blacklisted (default: forever)")
    elastic.add_argument("--elastic-timeout", type=_count(1),
                         help=f"seconds to wait for enough slots (default ${TIMEOUT_ENV} or {DEFAULT_ELASTIC_TIMEOUT_S})")
    parser.add_argument("--dry-run", action="store_true", help="print the command(s) and exit")
    parser.add_argument("--verbose", action="store_true")
    # Accepted so existing command lines keep working; they select engines triax does not have.
    for flag in ("--gloo", "--mpi", "--jsrun", "--tcp", "--disable-cache", "--timeline-mark-cycles",
                 "--autotune", "--no-stall-check", "--log-with-timestamp"):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for option in ("--output-filename", "--timeline-filename", "--log-level", "--fusion-threshold-mb",
                   "--cycle-time-ms", "--cache-capacity", "--mpi-args", "--config-file"):
        parser.add_argument(option, help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    return parser


def torchrun_commands(placed, command, port, restarts) -> list[tuple[str, list[str]]]:
    master = "127.0.0.1" if len(placed) == 1 else address_of(placed[0][0])
    if len(placed) > 1 and master in LOCAL_NAMES:
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


def supervise(hosts: list[str], started: list) -> int:
    """Wait for every host; the first failure stops the others. Returns the failing exit code."""
    try:
        while True:
            codes = [process.poll() for process in started]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                first = failed[0]
                others = [hosts[i] for i, code in enumerate(codes) if code is None]
                print(f"triax horovodrun: host {hosts[first]} (node {first}) exited with code {codes[first]}"
                      + (f"; stopping {', '.join(others)}" if others else ""), file=sys.stderr, flush=True)
                processes.stop(started)
                return codes[first]
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        processes.stop(started)
        raise


def _launch_fixed(args, command: list[str], extra_env: dict[str, str]) -> int:
    entries = parse_hosts(args.hosts, args.hostfile, args.np)
    np = args.np if args.np is not None else sum(slots for _, slots in entries)
    placed = place_processes(entries, np)
    port = args.master_port or free_port()
    launches = []
    for host, torchrun in torchrun_commands(placed, command, port, args.reset_limit or 0):
        if host in LOCAL_NAMES:
            launches.append((host, torchrun, None))
        else:
            launches.append((host, *processes.remote_start(host, torchrun, args, extra_env)))
    if args.dry_run or args.verbose:
        for host, command_argv, script in launches:
            line = f"[{host}] {shlex.join(command_argv)}"
            if script is not None:
                names = sorted(processes.forwarded_environment())
                line += f"  <<< cd + {len(names)} variable(s) on stdin ({', '.join(names) or 'none'}), then: " \
                        f"{script.strip().splitlines()[-1]}"
            print(line, flush=True)
        if args.dry_run:
            return 0
    started = []
    try:
        for host, command_argv, script in launches:
            started.append(processes.start(command_argv, script, {**os.environ, **extra_env}))
    except OSError as error:
        processes.stop(started)
        raise TriaxError(f"cannot start {command_argv[0]}: {error.strerror or error}") from None
    return supervise([host for host, _, _ in launches], started)


def elastic_settings(args, command: list[str], extra_env: dict[str, str] | None = None) -> ElasticSettings:
    """Check the elastic options (one line for the first wrong one) and gather them."""
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise TriaxError("pass either --host-discovery-script or -H/--hostfile, not both")
    np = args.np if args.np is not None else args.min_np
    if np is None:
        raise TriaxError("an elastic job needs -np N (the processes to start with) or --min-np N")
    min_np = args.min_np if args.min_np is not None else np
    if min_np > np:
        raise TriaxError(f"--min-np {min_np} is more than -np {np}; the job starts with -np processes")
    if args.max_np is not None and args.max_np < np:
        raise TriaxError(f"--max-np {args.max_np} is less than -np {np}; raise --max-np or lower -np")
    cooldown = None
    if args.cooldown_range:
        low, high = args.cooldown_range
        if not COOLDOWN_LOWEST_S <= low <= high <= COOLDOWN_HIGHEST_S:
            raise TriaxError(f"--blacklist-cooldown-range {low} {high}: need {COOLDOWN_LOWEST_S} <= MIN_S <= "
                             f"MAX_S <= {COOLDOWN_HIGHEST_S} (seconds)")
        cooldown = (low, high)
    if args.host_discovery_script:
        find_hosts = discovery.DiscoveryScript(args.host_discovery_script, args.slots)
    else:
        entries = parse_hosts(args.hosts, args.hostfile, np)
        if len(entries) < 2:  # Horovod's rule: a failing host is blacklisted, so one host cannot fail over
            raise TriaxError("an elastic job on fixed hosts needs at least 2 hosts in -H/--hostfile (Horovod "
                             "cannot run in fault tolerance mode with fewer); or use --host-discovery-script")
        find_hosts = discovery.FixedHosts(dict(entries))
    timeout = args.elastic_timeout
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        try:
            timeout = int(text) if text else DEFAULT_ELASTIC_TIMEOUT_S
        except ValueError:
            raise TriaxError(f"${TIMEOUT_ENV}={text!r} is not a whole number of seconds") from None
    return ElasticSettings(command=command, np=np, min_np=min_np, max_np=args.max_np, discovery=find_hosts,
                           reset_limit=args.reset_limit, cooldown_range=cooldown, elastic_timeout=timeout,
                           ssh=args, verbose=args.verbose, extra_env=dict(extra_env or {}))


def _worker_environment(args) -> None:
    """Exported before any worker starts: local ones inherit it, remote ones get it forwarded."""
    if args.gloo_timeout_seconds is not None:
        seconds = collective_timeout(args.gloo_timeout_seconds, "--gloo-timeout-seconds")
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = f"{seconds:g}"
    if args.network_interface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.network_interface
        os.environ["HOROVOD_GLOO_IFACE"] = args.network_interface.split(",")[0]


def main(argv: list[str] | None = None, extra_env: dict[str, str] | None = None) -> int:
    """The command line; `extra_env`: variables for every process of the job, beside ours
    (hvd.run passes its store's address and key this way)."""
    extra_env = dict(extra_env or {})
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise TriaxError("no training command given; e.g. triax horovodrun -np 2 python train.py")
    elastic = args.host_discovery_script is not None or args.min_np is not None
    if not elastic:
        for name, flag in ELASTIC_ONLY.items():
            if getattr(args, name) is not None:
                raise TriaxError(f"{flag} applies to elastic jobs only; add --min-np N or --host-discovery-script")
    settings = elastic_settings(args, command, extra_env) if elastic else None
    if settings is not None:
        settings.discovery.check()  # the script runs once now: a broken one stops the job before it starts
    _worker_environment(args)
    if settings is None:
        return _launch_fixed(args, command, extra_env)
    return run_elastic(settings, dry_run=args.dry_run)

