"""The job `triax horovodrun` and `hvd.run` start: Horovod's launcher, carried out by torchrun.

A fixed job is carried out by torchrun: one torchrun with --nproc-per-node on one host; on several
hosts one torchrun per host, started over ssh as horovodrun does (processes.py; inside a Slurm
allocation, as a job step with srun, and with the allocation's nodes as hosts when no -H is given),
with the first host as the rendezvous address. If one host's processes fail, the others are stopped and the failing
host is named. An elastic job (`--host-discovery-script` or `--min-np`, as Horovod decides) is run
by triax's elastic driver (elastic/driver.py). `--dry-run` prints the commands instead of running them.
Every option is checked before anything starts; a bad one is one line and exit code 2. The command
line is parsed by horovodrun_options.py (hvd.run takes the same options); the command's entry is
triax/commands/horovodrun.py.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from typing import TYPE_CHECKING

from triax.arguments import check_command
from triax.errors import TriaxError
from triax.horovod import horovodrun_options, processes
from triax.horovod.elastic import discovery
from triax.horovod.elastic.driver import ElasticSettings, run_elastic
from triax.horovod.elastic.protocol import DEFAULT_ELASTIC_TIMEOUT_S, TIMEOUT_ENV
from triax.horovod.horovodrun_options import check_timeout_environment, start_timeout, whole_seconds
from triax.horovod.hosts import LOCAL_NAMES, address_of, parse_hosts, place_processes
from triax.horovod.output import JobOutput, StartWatch
from triax.horovod.slots import assign
from triax.runtime.rendezvous import free_port

if TYPE_CHECKING:
    import argparse

# Horovod's bounds for --blacklist-cooldown-range (seconds)
COOLDOWN_LOWEST_S, COOLDOWN_HIGHEST_S = 1, 3600
ELASTIC_ONLY = {"max_np": "--max-np", "slots": "--slots-per-host", "cooldown_range": "--blacklist-cooldown-range",
                "elastic_timeout": "--elastic-timeout"}


def torchrun_commands(placed: list[tuple[str, int]], command: list[str], port: int, restarts: int,
                      timestamp: bool = False) -> list[tuple[str, list[str]]]:
    master = "127.0.0.1" if len(placed) == 1 else address_of(placed[0][0])
    if len(placed) > 1 and master in LOCAL_NAMES:
        master = socket.getfqdn()  # "localhost" would point each remote host at itself
    # Horovod's cross rank and size of each local rank on each host (hosts named by their index:
    # two entries may name the same machine)
    slots = assign([(str(node), procs) for node, (_, procs) in enumerate(placed)])
    commands = []
    for node_rank, (host, procs) in enumerate(placed):
        cross = ",".join(f"{slot.cross_rank}:{slot.cross_size}" for slot in slots if slot.hostname == str(node_rank))
        # Each worker starts through horovod_worker, which sets Horovod's HOROVOD_* variables first
        # and prefixes the worker's output with its rank.
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(placed)}",
                f"--node-rank={node_rank}", f"--nproc-per-node={procs}", f"--master-addr={master}",
                f"--master-port={port}", f"--max-restarts={restarts}", "--no-python",
                *processes.worker_command(command, timestamp, f"--hostname={host}", f"--cross={cross}")]
        commands.append((host, argv))
    return commands


def supervise(hosts: list[str], started: list, watch: StartWatch | None = None) -> int:
    """Wait for every host; the first failure stops the others. Returns the failing exit code.
    `watch`: --start-timeout, checked until every worker started."""
    try:
        while True:
            codes = [process.poll() for process in started]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                first = failed[0]
                others = [hosts[i] for i, code in enumerate(codes) if code is None]
                print(f"triax horovodrun: host {hosts[first]} (node {first}) exited with code {codes[first]}"
                      + (f"; stopping {', '.join(others)}" if others else ""), file=sys.stderr, flush=True)
                print(f"triax horovodrun: {processes.FAILURE_MESSAGE.format(name=hosts[first], code=codes[first])}",
                      file=sys.stderr, flush=True)
                processes.stop(started)
                return codes[first]
            if all(code == 0 for code in codes):
                return 0
            if watch is not None and watch.check(watch.ranks):
                watch = None  # every worker started
            time.sleep(0.2)
    except (KeyboardInterrupt, TriaxError):
        processes.stop(started)
        raise


def _launch_fixed(args: argparse.Namespace, command: list[str], extra_env: dict[str, str],
                  option_env: dict[str, str]) -> int:
    entries = parse_hosts(args.hosts, args.hostfile, args.np)
    np = args.np if args.np is not None else sum(slots for _, slots in entries)
    placed = place_processes(entries, np)
    port = args.master_port or free_port()
    launches = []
    job_env = {**option_env, **extra_env}
    for host, torchrun in torchrun_commands(placed, command, port, args.reset_limit or 0, args.prefix_timestamp):
        if host in LOCAL_NAMES:
            launches.append((host, torchrun, None))
        else:
            launches.append((host, *processes.remote_start(host, torchrun, args, job_env)))
    if args.dry_run or args.verbose:
        shown = "".join(f"{name}={shlex.quote(value)} " for name, value in option_env.items())
        for host, command_argv, script in launches:
            line = f"[{host}] {shown if script is None else ''}{shlex.join(command_argv)}"
            if script is not None:
                names = sorted(processes.forwarded_environment(option_env))
                line += f"  <<< cd + {len(names)} variable(s) on stdin ({', '.join(names) or 'none'}), then: " \
                        f"{script.strip().splitlines()[-1]}"
            print(line, flush=True)
        if args.dry_run:
            return 0
    output = JobOutput(args.output_filename, np)
    for rank in range(np):
        output.open_rank(rank)
    started = []
    try:
        for host, command_argv, script in launches:
            started.append(processes.start(command_argv, script, {**os.environ, **job_env}, pipes=True))
            output.follow(started[-1])
    except OSError as error:
        processes.stop(started)
        output.close()
        raise TriaxError(f"cannot start {command_argv[0]}: {error.strerror or error}") from None
    hosts_by_rank = {slot.rank: placed[int(slot.hostname)][0]
                     for slot in assign([(str(node), procs) for node, (_, procs) in enumerate(placed)])}
    watch = StartWatch(start_timeout(args), hosts_by_rank, output)
    try:
        return supervise([host for host, _, _ in launches], started, watch)
    finally:
        output.close()


def elastic_settings(args: argparse.Namespace, command: list[str],
                     extra_env: dict[str, str] | None = None) -> ElasticSettings:
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
        timeout = whole_seconds(text, TIMEOUT_ENV) if text else DEFAULT_ELASTIC_TIMEOUT_S
    return ElasticSettings(command=command, np=np, min_np=min_np, max_np=args.max_np, discovery=find_hosts,
                           reset_limit=args.reset_limit, cooldown_range=cooldown, elastic_timeout=timeout,
                           ssh=args, verbose=args.verbose, extra_env=dict(extra_env or {}),
                           start_timeout=start_timeout(args), output_filename=args.output_filename,
                           prefix_timestamp=args.prefix_timestamp)


def _check_local_command(args: argparse.Namespace, command: list[str]) -> None:
    """The training command, checked as `triax launch` checks its script: one line and exit 2
    before anything starts, not a traceback from every worker. Only a job on this host's
    processes: another host's files are that host's."""
    if not args.dry_run and args.host_discovery_script is None and all(
            host in LOCAL_NAMES for host, _ in parse_hosts(args.hosts, args.hostfile, args.np)):
        check_command(command, "triax horovodrun -np 2 python train.py")


def launch(args: argparse.Namespace, extra_env: dict[str, str] | None = None) -> int:
    """Run the job the parsed command line describes; `extra_env`: variables for every process of
    the job, beside ours (hvd.run passes its store's address and key this way)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise TriaxError("no training command given; e.g. triax horovodrun -np 2 python train.py")
    elastic = args.host_discovery_script is not None or args.min_np is not None
    if not elastic:
        for name, flag in ELASTIC_ONLY.items():
            if getattr(args, name) is not None:
                raise TriaxError(f"{flag} applies to elastic jobs only; add --min-np N or --host-discovery-script")
    option_env = horovodrun_options.worker_environment(args)
    extra_env = dict(extra_env or {})
    check_timeout_environment(args)  # a bad $HOROVOD_*_TIMEOUT stops the job before it starts
    if not elastic:
        _check_local_command(args, command)
        return _launch_fixed(args, command, extra_env, option_env)
    settings = elastic_settings(args, command, {**option_env, **extra_env})
    settings.discovery.check()  # the script runs once now: a broken one stops the job before it starts
    _check_local_command(args, command)
    return run_elastic(settings, dry_run=args.dry_run)
