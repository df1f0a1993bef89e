"""No silent hangs: a heartbeat watchdog that names the rank a job is waiting for.

A collective that never completes blocks every rank in C++ with no message until the process
group's timeout. So each rank runs a small background thread that, every few seconds, writes a
heartbeat to the job's key-value store (the TCPStore torchrun's agent hosts, over its own TCP
connection: it keeps working while gloo or NCCL is blocked) and reads its peers' heartbeats.
A heartbeat says what the rank is doing: step, phase (data / forward / backward / optimizer /
a collective / snapshot ...), for how long, and how long that phase is allowed to take.

Two kinds of failure are told apart:
- a rank goes *silent*: its heartbeat stops changing (the process or host is gone, or the link
  is cut) for `timeout_s`;
- a rank is *alive but stuck*: its heartbeat still beats, but it is the furthest behind of the
  live ranks (everyone else waits for it) and has been in one phase longer than that phase's
  allowance.
The rank that sees it first records one verdict in the store; every live rank then writes a
report (its Python stacks, its last phases, its peers' last heartbeats) into
<run_dir>/hang-<step>/ and exits with HANG_EXIT_CODE, so torchrun restarts or shrinks the job and
training resumes from the last snapshot. The main thread is stuck in a collective, so the exit is
os._exit from the watchdog's thread.

Slow phases (start-up, the first step with its compilation and lazy set-up, evaluation,
snapshots) get `slow_timeout_s`; every other phase gets the larger of `timeout_s` and 3x the
longest that phase has taken on this rank so far, so a model whose steps are legitimately long
does not raise false alarms.

Time in which the process was stopped as a whole does not count: a job suspended by Slurm
(`scontrol suspend`), stopped with Ctrl-Z or SIGSTOP, or on a paused virtual machine resumes where
it was, it has not hung. The watchdog's two threads wake several times a heartbeat interval; when
neither has run for PAUSE_INTERVALS intervals, the gap is taken as a pause and left out of every
age and silence this rank measures (its phase, its peers' last heartbeats, its last contact with
the store). A rank stopped alone still goes silent for its peers, and they stop the job.
"""

from __future__ import annotations

import collections
import datetime
import faulthandler
import json
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from triax.errors import TriaxError
from triax.runtime.rendezvous import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, attempt_store
from triax.runtime.timeouts import slow_phase_timeout

# EX_TEMPFAIL: a temporary failure; torchrun's restart is the retry.
HANG_EXIT_CODE = 75
LEARNED_FACTOR = 3  # a phase may take this many times its longest duration seen so far
PAUSE_INTERVALS = 3  # neither watchdog thread ran for this many heartbeat intervals: the process was stopped

# Order of the phases within one step, to find the rank that is furthest behind.
STEP_PHASES = {"data": 0, "forward": 1, "backward": 2, "pipeline schedule": 2, "optimizer": 3,
               "metrics all-gather": 4, "evaluation": 5, "snapshot": 6, "stop-agreement all-reduce": 7}
SLOW_PHASES = {"startup", "evaluation", "snapshot", "finish"}

_generation = 0  # watchdogs started in this process: each gets its own keys


class HangDetected(TriaxError, RuntimeError):
    """A rank never arrived at start-up (raised on the ranks that did)."""


def heartbeat_interval(timeout_s: float) -> float:
    # Several beats per timeout, so one late beat is never mistaken for silence.
    return min(5.0, max(0.2, timeout_s / 6))


def _describe_phase(phase: str, step: int) -> str:
    return phase if phase in ("startup", "finish") else f"{phase} of step {step}"


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class Watchdog:
    """`watch = Watchdog(run_dir, timeout_s, rank, world_size); watch.start()`, then
    `watch.phase("forward", step)` as work moves on, `watch.stop()` at the end."""

    def __init__(self, run_dir: str, timeout_s: float, rank: int, world_size: int, store: dist.Store | None = None,
                 slow_timeout_s: float | None = None, host: str | None = None,
                 address: tuple[str, int] | None = None):
        self.run_dir, self.timeout_s, self.rank, self.world_size = run_dir, timeout_s, rank, world_size
        self.slow_timeout_s = slow_timeout_s or slow_phase_timeout(timeout_s)
        self.interval_s = heartbeat_interval(timeout_s)
        self.host = host or socket.gethostname()
        self._store, self._address = store, address
        # The watchdog's clock: monotonic time less the pauses seen (_note_pause).
        self._paused_s, self._awake_at, self._clock_lock = 0.0, time.monotonic(), threading.Lock()
        # (phase, step, micro, entered at (the watchdog's clock), slow): replaced whole, read by the thread.
        self._current = ("startup", 0, 0, self._now(), True)
        self._history: collections.deque = collections.deque(maxlen=24)
        self._longest: dict[str, float] = {}
        self._beat = 0
        self._last_contact = self._now()
        self._peers: dict[int, dict] = {}
        self._last_change: dict[int, float] = {}
        self._stopping = threading.Event()
        self._fired = threading.Lock()
        self._threads: list[threading.Thread] = []

    # ---- the main thread's side -----------------------------------------------------------

    def phase(self, name: str, step: int, micro: int = 0, slow: bool = False) -> None:
        """Record that this rank now does `name` (of step `step`, micro-batch `micro`). `slow`
        gives the phase the slow allowance (e.g. the first step, which compiles)."""
        now = self._now()
        previous, old_step, _, entered, was_slow = self._current
        duration = now - entered
        self._history.append((previous, old_step, round(duration, 4)))
        if not was_slow:
            self._longest[previous] = max(self._longest.get(previous, 0.0), duration)
        self._current = (name, step, micro, now, slow or name in SLOW_PHASES)

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def hosts(self) -> dict[int, str]:
        """{rank: host name} of the ranks heard from."""
        return {rank: beat["host"] for rank, beat in self._peers.items()}

    def start(self) -> "Watchdog":
        """Join the job's heartbeats, wait until every rank has arrived (naming those that do not
        within the slow allowance), then start beating."""
        global _generation
        _generation += 1
        self._store = self._open_store(self._store, _generation)
        self._write_heartbeat()
        self._wait_for_every_rank()
        self._awake_at = time.monotonic()  # waiting for the others was not a pause
        for target in (self._beat_loop, self._contact_loop):
            thread = threading.Thread(target=target, name=f"triax-watchdog-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop watching; peers see this rank as finished, not silent."""
        if self._stopping.is_set():
            return
        self._current = ("finish", self._current[1], 0, self._now(), True)
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.interval_s + 1)
        try:
            self._write_heartbeat(finished=True)
        except Exception:  # the store may already be gone at the end of a job
            pass

    # ---- the store ------------------------------------------------------------------------

    def _open_store(self, store: dist.Store | None, generation: int):
        if store is None:
            # A connection of our own to the job's store: its operations time out after a few
            # beats instead of blocking, and a blocked main thread cannot hold it.
            host, port = self._address or (os.environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
                                           int(os.environ.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))))
            try:
                store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=max(2 * self.interval_s, 1.0)))
                self._address = (host, port)
            except (RuntimeError, ValueError):
                if not dist.is_initialized():
                    raise
                # A process group made by the caller with its own store: share that one.
                store = dist.distributed_c10d._get_default_store()
        # torchrun's agent keeps its store across restarts: every attempt gets fresh keys.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        return attempt_store(store, f"triax/watchdog/{run_id}/{generation}")

    def _heartbeat(self, finished: bool = False) -> dict:
        name, step, micro, entered, slow = self._current
        allowance = self.slow_timeout_s if slow else max(self.timeout_s,
                                                         LEARNED_FACTOR * self._longest.get(name, 0.0))
        return {"beat": self._beat, "host": self.host, "pid": os.getpid(), "phase": name, "step": step,
                "micro": micro, "age": round(self._now() - entered, 3), "allowance": allowance,
                "finished": finished}

    def _write_heartbeat(self, finished: bool = False) -> dict:
        self._beat += 1
        heartbeat = self._heartbeat(finished)
        self._store.set(f"heartbeat/{self.rank}", json.dumps(heartbeat))
        self._last_contact = self._now()
        return heartbeat

    def _wait_for_every_rank(self) -> None:
        keys = [f"heartbeat/{rank}" for rank in range(self.world_size)]
        deadline = time.monotonic() + self.slow_timeout_s
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = [rank for rank, key in enumerate(keys) if not self._store.check([key])]
                arrived = [rank for rank in range(self.world_size) if rank not in missing]
                hosts = self._read([f"heartbeat/{rank}" for rank in arrived])
                where = ", ".join(f"rank {rank} on {json.loads(h)['host']}" for rank, h in zip(arrived, hosts))
                raise HangDetected(
                    f"start-up: {_rank_list(missing)} of {self.world_size} did not arrive within "
                    f"{self.slow_timeout_s:g} s (arrived: {where}); check that process's output and "
                    f"host (it may have crashed or be stuck before training started)")
            time.sleep(min(0.1, self.interval_s))
        now = self._now()
        for rank, value in enumerate(self._read(keys)):
            self._peers[rank] = json.loads(value)
            self._last_change[rank] = now

    def _read(self, keys: list[str]) -> list[bytes]:
        return self._store.multi_get(keys) if len(keys) > 1 else [self._store.get(keys[0])]

    # ---- the watchdog's clock --------------------------------------------------------------

    def _now(self) -> float:
        return time.monotonic() - self._paused_s

    def _note_pause(self) -> None:
        """Called by each watchdog thread as it wakes: a gap since either last woke that is longer
        than PAUSE_INTERVALS intervals was a pause of the whole process, and leaves the clock."""
        with self._clock_lock:
            awake = time.monotonic()
            gap, self._awake_at = awake - self._awake_at, awake
            if gap > PAUSE_INTERVALS * self.interval_s:
                self._paused_s += gap - self.interval_s

    # ---- the watchdog's threads -----------------------------------------------------------

    def _beat_loop(self) -> None:
        keys = [f"heartbeat/{rank}" for rank in range(self.world_size)]
        while not self._stopping.wait(self.interval_s):
            self._note_pause()
            try:
                mine = self._write_heartbeat()
                if self._store.check(["verdict"]):
                    self._fire(json.loads(self._store.get("verdict")))
                    return
                values = self._read(keys)
            except Exception:
                continue  # the contact loop decides when missing the store is a failure
            now = self._now()
            for rank, value in enumerate(values):
                heartbeat = mine if rank == self.rank else json.loads(value)
                if self._peers.get(rank, {}).get("beat") != heartbeat["beat"]:
                    self._last_change[rank] = now
                self._peers[rank] = heartbeat
            verdict = self._judge(now)
            if verdict is not None and not self._stopping.is_set():
                try:
                    # The first rank to judge wins: every rank reports the same verdict.
                    stored = self._store.compare_set("verdict", "", json.dumps(verdict))
                    verdict = json.loads(stored)
                except Exception:
                    pass
                self._fire(verdict)
                return

    def _contact_loop(self) -> None:
        while not self._stopping.wait(self.interval_s / 2):
            self._note_pause()
            silent_for = self._now() - self._last_contact
            if silent_for > self.timeout_s:
                host, port = self._address or ("the process group's store", "")
                name, step = self._current[0], self._current[1]
                self._fire({
                    "author": self.rank, "kind": "isolated", "ranks": [self.rank], "step": step,
                    "message": f"rank {self.rank} on {self.host} lost contact with the job's store at "
                               f"{host}:{port} for {_seconds(silent_for)} during {_describe_phase(name, step)} "
                               "(this host's network is down, or the store's host is gone)"})
                return

    def _judge(self, now: float) -> dict | None:
        peers = self._peers
        running = [rank for rank, beat in peers.items() if not beat["finished"]]
        silent = sorted(rank for rank in running if rank != self.rank
                        and now - self._last_change.get(rank, now) > self.timeout_s)
        if silent:
            first = peers[silent[0]]
            hosts = sorted({peers[rank]["host"] for rank in silent})
            quiet = now - max(self._last_change[rank] for rank in silent)
            return {"author": self.rank, "kind": "silent", "ranks": silent, "step": first["step"],
                    "message": f"{_rank_list(silent)} on {', '.join(hosts)} stopped responding during "
                               f"{_describe_phase(first['phase'], first['step'])} "
                               f"(no heartbeat for {_seconds(quiet)})"}
        if not running:
            return None

        def progress(rank: int):
            beat = peers[rank]
            # Outside the step loop (start-up) counts as before any step.
            return (beat["step"], STEP_PHASES.get(beat["phase"], -1), beat["micro"])

        behind = min(progress(rank) for rank in running)
        stuck = sorted(rank for rank in running
                       if progress(rank) == behind and peers[rank]["age"] > peers[rank]["allowance"])
        if not stuck:
            return None
        first = peers[stuck[0]]
        hosts = sorted({peers[rank]["host"] for rank in stuck})
        waiting = "" if len(stuck) == len(running) else "; the other ranks wait for it"
        return {"author": self.rank, "kind": "stuck", "ranks": stuck, "step": first["step"],
                "message": f"{_rank_list(stuck)} on {', '.join(hosts)} stuck in "
                           f"{_describe_phase(first['phase'], first['step'])} for {_seconds(first['age'])} "
                           f"(allowed {_seconds(first['allowance'])}; its heartbeat still beats{waiting})"}

    def _fire(self, verdict: dict) -> None:
        """Write this rank's report, let the other live ranks write theirs, exit."""
        if not self._fired.acquire(blocking=False) or self._stopping.is_set():
            return
        report_dir = os.path.join(self.run_dir, f"hang-{int(verdict.get('step', 0)):04d}")
        try:
            self._write_report(report_dir, verdict)
        except Exception as error:  # a report that cannot be written must not stop the exit
            print(f"triax: watchdog: could not write the report to {report_dir}: {error}", file=sys.stderr)
        if verdict.get("author") == self.rank:
            print(f"triax: {verdict['message']}; report: {report_dir}/", file=sys.stderr, flush=True)
        if verdict["kind"] != "isolated":
            self._wait_for_reports(verdict)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def _wait_for_reports(self, verdict: dict) -> None:
        # The first rank to exit makes torchrun stop the others: give them a few beats to report.
        gone = set(verdict["ranks"]) if verdict["kind"] == "silent" else set()
        expected = sum(1 for rank, beat in self._peers.items() if not beat["finished"] and rank not in gone)
        deadline = time.monotonic() + 3 * self.interval_s + 1
        try:
            done = self._store.add("reported", 1)
            while done < expected and time.monotonic() < deadline:
                time.sleep(min(0.1, self.interval_s))
                done = self._store.add("reported", 0)
        except Exception:
            pass

    def _write_report(self, report_dir: str, verdict: dict) -> None:
        os.makedirs(report_dir, exist_ok=True)
        name, step, micro, entered, _ = self._current
        now = self._now()
        lines = [f"triax watchdog report: rank {self.rank} of {self.world_size} on {self.host} (pid {os.getpid()})",
                 f"verdict (by rank {verdict.get('author')}): {verdict['message']}",
                 f"written at {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
                 f"timeouts: {self.timeout_s:g} s per step phase, {self.slow_timeout_s:g} s for slow phases",
                 "", f"this rank: {_describe_phase(name, step)} (micro-batch {micro}) for {now - entered:.1f} s",
                 "last phases (oldest first; phase, step, seconds):"]
        lines += [f"  {phase:<26} {phase_step:>7} {duration:>10}" for phase, phase_step, duration in self._history]
        lines += ["", "peers' last heartbeats:"]
        for rank in sorted(self._peers):
            beat = self._peers[rank]
            heard = now - self._last_change.get(rank, now)
            state = "finished" if beat["finished"] else (
                f"{_describe_phase(beat['phase'], beat['step'])} for {beat['age']:.1f} s "
                f"(allowed {beat['allowance']:.0f} s)")
            lines.append(f"  rank {rank} on {beat['host']} (pid {beat['pid']}): {state}; "
                         f"heartbeat last changed {heard:.1f} s ago")
        lines += ["", "Python stacks of every thread of this rank:", ""]
        path = os.path.join(report_dir, f"rank{self.rank}.txt")
        with open(path, "w") as handle:
            handle.write("\n".join(lines) + "\n")
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        if verdict.get("author") == self.rank:
            with open(os.path.join(report_dir, "verdict.json"), "w") as handle:
                json.dump(verdict, handle, indent=1)
