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

import random
import shlex
import shutil
import os
import subprocess
import time

from triax.errors import TriaxError
from triax.horovod.elastic.protocol import ADDED, NO_UPDATE, REMOVED
from triax.horovod.hosts import entry, split_host_slots

DISCOVERY_TIMEOUT_S = 60  # one run of the discovery script; it is expected to answer at once
MAX_OUTPUT_LINES = 100_000


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
        try:
            # A shell runs it, as horovodrun does: the value is the user's own command line.
            result = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                    timeout=DISCOVERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"the host discovery script {self.script!r} did not answer in "
                                 f"{DISCOVERY_TIMEOUT_S}s") from None
        except OSError as error:
            raise DiscoveryError(f"cannot run the host discovery script {self.script!r}: {error}") from None
        if result.returncode != 0:
            detail = (result.stderr.strip().splitlines() or [""])[-1][:200]
            raise DiscoveryError(f"the host discovery script {self.script!r} exited with code {result.returncode}"
                                 + (f": {detail}" if detail else ""))
        return self.parse(result.stdout)

    def parse(self, text: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for number, line in enumerate(text.splitlines()[:MAX_OUTPUT_LINES], 1):
            line = line.strip()
            if not line:
                continue  # nothing available is a valid answer
            default = None if self.default_slots is None else str(self.default_slots)
            host, slots = split_host_slots(line, default)
            if slots is None:
                raise DiscoveryError(f"the host discovery script printed {line!r} (line {number}) without slots; "
                                     "print host:slots or pass --slots-per-host N")
            host, count = entry(host, slots, f"host discovery script line {number}", minimum=0)
            found[host] = count
        return found


class FixedHosts:
    """`--min-np` with -H/--hostfile: the same hosts every time (only the blacklist changes)."""

    def __init__(self, hosts: dict[str, int]):
        self.hosts = dict(hosts)

    def check(self) -> None:
        pass

    def find(self) -> dict[str, int]:
        return dict(self.hosts)


class _HostState:
    def __init__(self, cooldown_range):
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

    def __init__(self, cooldown_range=None):
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
