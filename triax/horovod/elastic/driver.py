"""The elastic driver of `triax horovodrun --host-discovery-script S --min-np N --max-np M`.

Horovod's elastic driver, on torch.distributed's TCPStore (protocol.py). It serves the store,
runs the discovery script every second, and starts one worker process per assigned slot: here,
or over ssh on another host (processes.py). Every worker gets Horovod's environment (HOROVOD_RANK,
HOROVOD_SIZE, HOROVOD_LOCAL_*, HOROVOD_CROSS_*, HOROVOD_HOSTNAME, HOROVOD_ELASTIC=1,
HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT).

When the hosts change in a way that changes the assignment, the driver sends a notice; the
workers raise HostsUpdatedInterrupt at their next commit and come back READY. When a worker
fails, the others fail in their next collective (HorovodInternalError), restore the last commit
and come back READY. Once every worker of the round is READY or gone, the driver decides, as
Horovod's does:
- a worker succeeded: the job is over (its exit code: the first failure's, else 0);
- every worker failed, or every host is blacklisted: the job failed;
- else the failing workers' hosts are blacklisted; past --reset-limit resets the job stops;
  otherwise it waits (up to --elastic-timeout) for --min-np slots, assigns up to --max-np
  processes with the oldest hosts first, tells each ready worker its new slot (or that it was
  removed) and starts workers for the new slots.
"""

from __future__ import annotations

import datetime
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TYPE_CHECKING

import torch.distributed as dist

from triax.errors import TriaxError
from triax.horovod import processes
from triax.horovod.elastic import protocol
from triax.horovod.elastic.discovery import DiscoveryError, HostManager
from triax.horovod.hosts import address_toward, is_local
from triax.horovod.output import JobOutput, StartWatch
from triax.horovod.slots import SlotInfo, assign

if TYPE_CHECKING:
    from types import FrameType

DISCOVERY_PERIOD_S = 1.0  # Horovod's DISCOVER_HOSTS_FREQUENCY_SECS
POLL_PERIOD_S = 0.1
REMOVED_GRACE_S = 30.0  # a removed worker leaves by itself; after this it is stopped
RESET_LIMIT_MESSAGE = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"


@dataclass
class ElasticSettings:
    command: list[str]
    np: int
    min_np: int
    max_np: int | None
    discovery: Any  # discovery.DiscoveryScript or FixedHosts
    reset_limit: int | None
    cooldown_range: tuple[int, int] | None
    elastic_timeout: float
    ssh: Any  # ssh_option, ssh_port, ssh_identity_file (the command line's)
    verbose: bool = False
    extra_env: dict = field(default_factory=dict)  # for every worker, beside Horovod's variables
    start_timeout: float = 30.0  # for the first round's workers to start (--start-timeout)
    output_filename: str | None = None  # --output-filename: each rank's output also goes there
    prefix_timestamp: bool = False  # --prefix-output-with-timestamp


@dataclass
class _Worker:
    name: str  # its key in the store
    slot: SlotInfo
    process: Any
    ready: bool = False
    exit_code: int | None = None
    removed_at: float = 0.0
    failed_at: float = 0.0  # when its non-zero exit was seen: the first failure is named at the end

    @property
    def where(self) -> str:
        return f"{self.slot.hostname}[{self.slot.local_rank}]"


@dataclass
class _Driver:
    settings: ElasticSettings
    store: Any = None
    port: int = 0
    hosts: HostManager = None
    round: int = 0
    workers: dict = field(default_factory=dict)  # name -> _Worker of this round
    leaving: list = field(default_factory=list)  # removed workers not gone yet
    assignment: list = field(default_factory=list)
    resets: int = 0
    notices: int = 0
    next_discovery: float = 0.0
    names: Any = field(default_factory=lambda: itertools.count())
    output: JobOutput = None
    watch: StartWatch | None = None  # until the first round's workers have all started

    # ---- hosts ----------------------------------------------------------------------------------
    def discover(self, first: bool = False) -> None:
        try:
            found = self.settings.discovery.find()
        except DiscoveryError as error:
            if first:
                raise
            self.say(f"{error}; trying again")  # Horovod retries after the first call
            return
        if self.settings.verbose and found != self.hosts.slots:
            self.say(f"the discovery script now lists {self.describe(list(found.items())) or 'no hosts'}")
        flags = self.hosts.update(found)
        if flags != protocol.NO_UPDATE and self.workers:
            self.notify(flags)

    def planned(self) -> list[SlotInfo]:
        if self.hosts.available_slots() < self.settings.min_np:
            return []
        return assign(self.hosts.available(), self.settings.max_np)

    def notify(self, flags: int) -> None:
        """Tell the workers, unless the change would not change the assignment (Horovod's rule)."""
        if self.planned() == self.assignment:
            return
        self.notices += 1
        self.store.set(protocol.notice_key(self.notices), str(flags))
        self.store.add(protocol.NOTICE_COUNT_KEY, 1)
        kind = {protocol.ADDED: "added", protocol.REMOVED: "removed"}.get(flags, "added and removed")
        self.say(f"hosts {kind}: {self.describe(self.hosts.available())}; asking the workers to reset at their next commit")

    def wait_for_slots(self, count: int) -> None:
        deadline = time.monotonic() + self.settings.elastic_timeout
        while self.hosts.available_slots() < count:
            if time.monotonic() >= deadline:
                raise TriaxError(f"timed out after {self.settings.elastic_timeout:g}s waiting for {count} slot(s) "
                                 f"(available: {self.describe(self.hosts.available()) or 'none'}); check the "
                                 "discovery script, or raise --elastic-timeout")
            self.reap()
            time.sleep(DISCOVERY_PERIOD_S)
            self.discover()

    # ---- workers --------------------------------------------------------------------------------
    def start_worker(self, slot: SlotInfo) -> None:
        name = f"w{next(self.names)}"
        local = is_local(slot.hostname)
        env = {**self.settings.extra_env, **slot.environment(),
               protocol.ELASTIC_ENV: "1", protocol.ADDRESS_ENV: "127.0.0.1" if local else address_toward(slot.hostname),
               protocol.PORT_ENV: str(self.port), protocol.WORKER_ENV: name, protocol.ROUND_ENV: str(self.round),
               protocol.NOTICES_ENV: str(self.notices), protocol.TIMEOUT_ENV: f"{self.settings.elastic_timeout:g}",
               "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "PYTHONUNBUFFERED": "1"}
        # horovod_worker runs the command and prefixes its output with the rank, as Horovod's launcher does
        argv = processes.worker_command(self.settings.command, self.settings.prefix_timestamp)
        try:
            if local:
                process = processes.start(argv, env={**os.environ, **env}, pipes=True)
            else:
                process = processes.start(*processes.remote_start(slot.hostname, argv, self.settings.ssh, env),
                                          pipes=True)
        except OSError as error:
            raise TriaxError(f"cannot start {argv[0]}: {error.strerror or error}") from None
        # Horovod's files are per rank; a later worker with a rank an earlier one had adds to them
        self.output.open_rank(slot.rank, append=self.round > 0)
        self.output.follow(process)
        self.workers[name] = _Worker(name, slot, process)
        if self.settings.verbose:
            self.say(f"started {name} on {slot.hostname}[{slot.local_rank}] as rank {slot.rank} of {slot.size} "
                     f"(pid {process.pid})")

    def reap(self) -> None:
        """Note workers that exited, and workers that came back READY."""
        for worker in self.workers.values():
            if worker.exit_code is None:
                worker.exit_code = worker.process.poll()
                if worker.exit_code not in (None, 0):
                    worker.failed_at = time.monotonic()
                    self.say(f"worker {worker.where} (rank {worker.slot.rank}) exited with code {worker.exit_code}")
            if worker.exit_code is None and not worker.ready:
                worker.ready = self.store.check([protocol.ready_key(self.round, worker.name)])
        now = time.monotonic()
        for worker in self.leaving:
            if worker.process.poll() is None and now - worker.removed_at > REMOVED_GRACE_S:
                processes.stop([worker.process], grace_s=1.0)
        self.leaving = [worker for worker in self.leaving if worker.process.poll() is None]

    def all_recorded(self) -> bool:
        return all(worker.ready or worker.exit_code is not None for worker in self.workers.values())

    # ---- rounds ---------------------------------------------------------------------------------
    def decide(self) -> int | None:
        """Everyone of this round is ready or gone: the job's exit code, or None to go on."""
        workers = list(self.workers.values())
        failed = sorted((w for w in workers if w.exit_code not in (None, 0)), key=lambda w: w.failed_at)
        if any(w.exit_code == 0 for w in workers):
            return self.failure(failed[0]) if failed else 0
        if len(failed) == len(workers):
            self.say(f"every worker of round {self.round} failed; stopping")
            return self.failure(failed[0])
        for worker in failed:
            if not self.hosts.is_blacklisted(worker.slot.hostname):
                self.say(f"blacklisting host {worker.slot.hostname}")
            self.hosts.blacklist(worker.slot.hostname)
        if all(self.hosts.is_blacklisted(w.slot.hostname) for w in workers):
            self.say("every host of the job is blacklisted; stopping")
            return self.failure(failed[0])
        if self.settings.reset_limit is not None and self.resets >= self.settings.reset_limit:
            self.say(RESET_LIMIT_MESSAGE.format(self.settings.reset_limit))
            return 1
        self.resets += 1
        self.next_round()
        return None

    def failure(self, first: int) -> int:
        """The job ends because of `first`, the first worker to fail: Horovod's message; its code."""
        self.say(processes.FAILURE_MESSAGE.format(name=first.where, code=first.exit_code))
        return first.exit_code

    def next_round(self) -> None:
        self.wait_for_slots(self.settings.min_np)
        assignment = self.planned()
        before = {slot.hostname for slot in self.assignment}
        if before and not before & {slot.hostname for slot in assignment}:
            raise TriaxError("no host of the previous round is left, so no worker has the state to hand on; "
                             "stopping (Horovod's rule)")
        self.round += 1
        self.assignment = assignment
        by_place = {(slot.hostname, slot.local_rank): slot for slot in assignment}
        survivors = {}
        for worker in self.workers.values():
            if not worker.ready or worker.exit_code is not None:
                continue
            slot = by_place.pop((worker.slot.hostname, worker.slot.local_rank), None)
            key = protocol.assignment_key(self.round, worker.name)
            if slot is None:
                self.store.set(key, protocol.REMOVED_ANSWER)
                worker.removed_at = time.monotonic()
                self.leaving.append(worker)
                continue
            self.store.set(key, f"{slot.encode()};{self.notices}")
            survivors[worker.name] = _Worker(worker.name, slot, worker.process)
        self.workers = survivors
        for slot in by_place.values():
            self.start_worker(slot)
        self.say(f"round {self.round}: {len(assignment)} worker(s) on {self.describe(self.hosts.available())} "
                 f"(reset {self.resets})")

    # ---- the whole job --------------------------------------------------------------------------
    def run(self) -> int:
        self.hosts = HostManager(self.settings.cooldown_range)
        self.output = JobOutput(self.settings.output_filename, self.settings.np)
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.settings.elastic_timeout))
        self.port = self.store.port
        self.discover(first=True)
        self.wait_for_slots(self.settings.np)
        self.assignment = assign(self.hosts.available(), self.settings.max_np)
        self.watch = StartWatch(self.settings.start_timeout, {s.rank: s.hostname for s in self.assignment},
                                self.output)
        for slot in self.assignment:
            self.start_worker(slot)
        self.say(f"round 0: {len(self.assignment)} worker(s) on {self.describe(self.hosts.available())}")
        while True:
            now = time.monotonic()
            if now >= self.next_discovery:
                self.discover()
                self.next_discovery = now + DISCOVERY_PERIOD_S
            self.reap()
            if self.watch is not None and (self.round > 0 or self.watch.check(
                    w.slot.rank for w in self.workers.values() if w.exit_code is None)):
                self.watch = None  # the first round's workers started (or the job went on without them)
            if self.all_recorded():
                code = self.decide()
                if code is not None:
                    return code
            time.sleep(POLL_PERIOD_S)

    def stop_all(self) -> None:
        processes.stop([w.process for w in [*self.workers.values(), *self.leaving]])
        if self.output is not None:
            self.output.close()

    def describe(self, hosts: list[tuple[str, int]]) -> str:
        return ", ".join(f"{host}:{slots}" for host, slots in hosts)

    def say(self, message: str) -> None:
        # One write per line (print writes the newline separately when unbuffered): the workers
        # write to the same terminal, and a line of theirs must not land inside one of ours.
        sys.stderr.write(f"triax horovodrun: {message}\n")
        sys.stderr.flush()


def run_elastic(settings: ElasticSettings, dry_run: bool = False) -> int:
    """Run the elastic job to its end; its exit code."""
    if dry_run:
        hosts = HostManager(settings.cooldown_range)
        hosts.update(settings.discovery.find())
        for slot in assign(hosts.available(), settings.max_np):
            variables = " ".join(f"{k}={v}" for k, v in slot.environment().items())
            print(f"[{slot.hostname}] {variables} {' '.join(settings.command)}", flush=True)
        return 0
    driver = _Driver(settings)

    def on_terminate(signum: int, frame: FrameType | None):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_terminate)
    try:
        return driver.run()
    except KeyboardInterrupt:
        driver.say("interrupted; stopping the workers")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        driver.stop_all()
