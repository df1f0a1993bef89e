"""Which hosts an elastic job may use now: the discovery script, fixed hosts, and the blacklist.

Horovod's rules, which its users' scripts and expectations are written against:
- The discovery script prints one available host a line, `host` or `host:slots`
  (`--slots-per-host` for the first form). A non-zero exit on the first call stops the job; later
  failures are reported and retried.
- Hosts keep the order in which they first appeared, so the oldest hosts hold the lowest ranks
  (rank 0, which every new worker syncs from, stays on a host that has the state).
- A host where a worker failed is blacklisted: it gets no slots. Without `--blacklist-cooldown-range`
  it stays so; with MIN MAX it comes back after MIN * 2^k + (0..MIN) seconds (k: its blacklistings
  so far), kept within [MIN, MAX], and its return counts as an added host.
"""

from __future__ import annotations

import os
import random
import selectors
import shlex
import shutil
import signal
import subprocess
import time

from triax.errors import TriaxError, printable
from triax.horovod.elastic.protocol import ADDED, NO_UPDATE, REMOVED
from triax.horovod.hosts import check_total, entry, split_host_slots

DISCOVERY_TIMEOUT_S = 60  # one run of the discovery script; it is expected to answer at once
MAX_OUTPUT_LINES = 100_000
MAX_OUTPUT_BYTES = 4 << 20  # 100,000 lines of 'host:slots' and more; more is not a host list


class DiscoveryError(TriaxError):
    """The discovery script failed or printed something that is not a host list."""


class DiscoveryScript:
    def __init__(self, script: str, default_slots: int | None):
        self.script = script
        self.default_slots = default_slots

    def check(self) -> None:
        """Before the job starts: the script exists, runs and prints a host list (one line if not)."""
        try:
            words = shlex.split(self.script)
        except ValueError as error:
            raise DiscoveryError(f"--host-discovery-script {self.script!r} cannot be split into words: {error}") from None
        if not words:
            raise DiscoveryError("--host-discovery-script is empty; give the path of an executable script")
        program = words[0]
        if os.sep in program:
            if not os.path.isfile(program):
                raise DiscoveryError(f"--host-discovery-script: {program} does not exist")
            if not os.access(program, os.X_OK):
                raise DiscoveryError(f"--host-discovery-script: {program} is not executable; chmod +x {program}")
        elif shutil.which(program) is None:
            raise DiscoveryError(f"--host-discovery-script: {program!r} is not a command on PATH; give its path")
        self.find()

    def find(self) -> dict[str, int]:
        """{host: slots} as the script prints it now."""
        code, output, errors = _run_capped(self.script, DISCOVERY_TIMEOUT_S, MAX_OUTPUT_BYTES)
        if code != 0:
            detail = printable((errors.decode("utf-8", "replace").strip().splitlines() or [""])[-1][:200])
            raise DiscoveryError(f"the host discovery script {self.script!r} exited with code {code}"
                                 + (f": {detail}" if detail else ""))
        try:
            text = output.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DiscoveryError(f"the host discovery script {self.script!r} printed bytes that are not UTF-8 text "
                                 f"(byte {error.start}); print one host or host:slots a line") from None
        return self.parse(text)

    def parse(self, text: str) -> dict[str, int]:
        found: dict[str, int] = {}
        lines = text.splitlines()
        if len(lines) > MAX_OUTPUT_LINES:
            raise DiscoveryError(f"the host discovery script printed {len(lines)} lines, more than the "
                                 f"{MAX_OUTPUT_LINES} hosts triax horovodrun reads; print the available hosts only")
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                continue  # nothing available is a valid answer
            default = None if self.default_slots is None else str(self.default_slots)
            host, slots = split_host_slots(line, default)
            if slots is None:
                raise DiscoveryError(f"the host discovery script printed {printable(line)[:200]!r} (line {number}) "
                                     "without slots; print host:slots or pass --slots-per-host N")
            host, count = entry(host, slots, f"host discovery script line {number}", minimum=0)
            found[host] = count
        check_total(found.items(), "the host discovery script's hosts")
        return found


def _run_capped(command: str, timeout_s: float, max_bytes: int) -> tuple[int, bytes, bytes]:
    """(exit code, stdout, stderr) of `command` run by a shell, as horovodrun runs the script (the
    value is the user's own command line). Its output is read as it comes, and the script, with
    everything it started (its own process group), is killed once it prints more than `max_bytes`
    on either stream or runs past `timeout_s`: `yes localhost:1` is refused in a moment instead
    of being read until memory runs out, and a hung script does not hang the job."""
    try:
        process = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
    except OSError as error:
        raise DiscoveryError(f"cannot run the host discovery script {command!r}: {error}") from None
    received = {process.stdout: bytearray(), process.stderr: bytearray()}
    deadline = time.monotonic() + timeout_s
    try:
        with selectors.DefaultSelector() as selector:
            for pipe in received:
                selector.register(pipe, selectors.EVENT_READ)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DiscoveryError(f"the host discovery script {command!r} did not answer in {timeout_s:g}s")
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    received[key.fileobj] += chunk
                    if len(received[key.fileobj]) > max_bytes:
                        raise DiscoveryError(f"the host discovery script {command!r} printed more than {max_bytes} "
                                             "bytes; print one available host a line")
        try:
            code = process.wait(max(deadline - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"the host discovery script {command!r} did not answer in {timeout_s:g}s") from None
    finally:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except OSError:
                pass
            process.wait()
        process.stdout.close()
        process.stderr.close()
    return code, bytes(received[process.stdout]), bytes(received[process.stderr])


class FixedHosts:
    """`--min-np` with -H/--hostfile: the same hosts every time (only the blacklist changes)."""

    def __init__(self, hosts: dict[str, int]):
        self.hosts = dict(hosts)

    def check(self) -> None:
        pass

    def find(self) -> dict[str, int]:
        return dict(self.hosts)


class _HostState:
    def __init__(self, cooldown_range: tuple[int, int] | list[int] | None):
        self.cooldown_range = cooldown_range
        self.blacklisted = False
        self.times_blacklisted = 0
        self.cooldown_ends = 0.0  # time.monotonic(); 0: no cooldown running

    def blacklist(self, now: float) -> None:
        self.blacklisted = True
        if self.cooldown_range is None or self.cooldown_ends > now:
            return
        low, high = self.cooldown_range
        self.times_blacklisted += 1
        delay = low * (1 << self.times_blacklisted) + random.uniform(0, 1) * low
        self.cooldown_ends = now + max(low, min(high, delay))

    def resurrected(self, now: float) -> bool:
        """Blacklisted and its cooldown is over."""
        return self.blacklisted and 0 < self.cooldown_ends <= now

    def whitelist(self) -> None:
        self.blacklisted = False
        self.cooldown_ends = 0.0


class HostManager:
    """The hosts discovered last, their order, and the blacklist."""

    def __init__(self, cooldown_range: tuple[int, int] | list[int] | None = None):
        self.cooldown_range = cooldown_range
        self.slots: dict[str, int] = {}
        self.order: list[str] = []  # first appearance first, blacklisted ones left out
        self.states: dict[str, _HostState] = {}

    def _state(self, host: str) -> _HostState:
        if host not in self.states:
            self.states[host] = _HostState(self.cooldown_range)
        return self.states[host]

    def update(self, found: dict[str, int], now: float | None = None) -> int:
        """Take the discovery's answer; Horovod's HostUpdateResult flags of what changed."""
        now = time.monotonic() if now is None else now
        coming_back = [host for host in found if self._state(host).resurrected(now)]
        if found == self.slots and not coming_back:
            return NO_UPDATE
        flags = NO_UPDATE
        for host, slots in self.slots.items():
            if found.get(host, 0) < slots:
                flags |= REMOVED
        for host, slots in found.items():
            if slots > self.slots.get(host, 0) or host in coming_back:
                flags |= ADDED
        for host in coming_back:
            self._state(host).whitelist()
        self.slots = dict(found)
        available = [host for host in found if not self._state(host).blacklisted]
        self.order = [host for host in self.order if host in available]
        self.order += [host for host in available if host not in self.order]
        return flags

    def blacklist(self, host: str, now: float | None = None) -> None:
        self._state(host).blacklist(time.monotonic() if now is None else now)
        self.order = [name for name in self.order if name != host]

    def is_blacklisted(self, host: str) -> bool:
        return self._state(host).blacklisted

    def available(self) -> list[tuple[str, int]]:
        """(host, slots) in assignment order, blacklisted hosts left out."""
        return [(host, self.slots[host]) for host in self.order if self.slots.get(host, 0) > 0]

    def available_slots(self) -> int:
        return sum(slots for _, slots in self.available())
