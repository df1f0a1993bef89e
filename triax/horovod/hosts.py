"""Hosts for `triax horovodrun`: `-H host:slots,...`, a hostfile, a discovery script's lines, the
Slurm allocation it runs in when none of those is given (triax.runtime.slurm.allocation_hosts), and
whether a host is this machine.

Host names are validated (letters, digits, '.', '-', '_', optional user@, or a bracketed IPv6
address; never a leading '-', so no name can be read as an ssh option).
"""

from __future__ import annotations

import os
import re
import socket

from triax import safe_files
from triax.runtime import slurm
from triax.errors import TriaxError

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
# A host: a name or address (optionally user@), or a bracketed IPv6 address; never an option.
_HOST = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?(?:[A-Za-z0-9_][A-Za-z0-9_.%-]*|\[[0-9A-Fa-f:.%]+\])$")
MAX_HOSTFILE_BYTES = 1 << 20  # one 'host slots=N' line per host: far more hosts than any job
# Processes of one job, on one host or on all of them together. Horovod's largest jobs are a few
# thousand GPUs; a bigger number is a typo or a runaway discovery script, and would be met by
# one object per slot (the placement) before anything else could refuse it.
MAX_PROCESSES = 65536


def entry(host: str, slots: str, where: str, minimum: int = 1) -> tuple[str, int]:
    """(host, slots) from text, or one line saying what is wrong with it."""
    if not _HOST.match(host):
        raise TriaxError(f"{where}: {host!r} is not a host name (letters, digits, '.', '-', '_', optional "
                         "user@; it may not start with '-')")
    try:
        count = int(slots)
    except ValueError:
        raise TriaxError(f"{where}: slots={slots!r} is not a whole number; e.g. {host}:4") from None
    if count < minimum:
        raise TriaxError(f"{where}: slots={count} must be at least {minimum}")
    if count > MAX_PROCESSES:
        raise TriaxError(f"{where}: slots={count} is more than the {MAX_PROCESSES} processes triax horovodrun "
                         "starts in one job")
    return host, count


def check_total(entries: list[tuple[str, int]], where: str) -> None:
    """The slots of all `entries` together stay within MAX_PROCESSES."""
    total = sum(slots for _, slots in entries)
    if total > MAX_PROCESSES:
        raise TriaxError(f"{where} offer {total} slots in all, more than the {MAX_PROCESSES} processes triax "
                         "horovodrun starts in one job; list fewer hosts or slots")


def split_host_slots(item: str, default_slots: str = "1") -> tuple[str, str]:
    """'host:4' -> ('host', '4'); 'host' (or a bare IPv6 address) -> ('host', default_slots)."""
    name, colon, slots = item.strip().rpartition(":")
    if not colon or name.endswith(":"):
        return item.strip(), default_slots
    return name, slots


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
            entries.append(entry(words[0], slots, f"{hostfile}:{number}"))
        if not entries:
            raise TriaxError(f"the hostfile {hostfile} lists no hosts; write one 'host slots=N' per line")
    elif hosts:
        for item in hosts.split(","):
            entries.append(entry(*split_host_slots(item), f"-H entry {item!r}"))
    else:
        where = "the hosts of SLURM_JOB_NODELIST"
        if (np or 1) > MAX_PROCESSES:
            raise TriaxError(f"-np {np} is more than the {MAX_PROCESSES} processes triax horovodrun starts in one job")
        # No hosts given: inside a Slurm allocation its nodes (horovodrun's own rule is this machine).
        entries = slurm.allocation_hosts(os.environ) or [("localhost", np or 1)]
    check_total(entries, f"the hostfile {hostfile}" if hostfile else "the hosts of -H" if hosts else where)
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


def address_of(host: str) -> str:
    """The address ssh would reach `host` at (user@ and IPv6 brackets removed)."""
    return host.rpartition("@")[2].strip("[]")


def is_local(host: str) -> bool:
    """True if `host` is this machine: one of its names, or an address one of its interfaces has
    (binding to an address succeeds only where it is local), as horovodrun decides."""
    name = address_of(host)
    if name in LOCAL_NAMES:
        return True
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def address_toward(host: str) -> str:
    """This machine's address on the route to `host`: where a process there can reach us.
    (A datagram socket's connect sends nothing; it only picks the route.)"""
    family, _, _, _, address = socket.getaddrinfo(address_of(host), 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]
