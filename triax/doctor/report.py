"""The doctor's findings: one `Check` per line, the table on the terminal and the JSON file.

A check is "ok", "warning" (a run works, slower or riskier than it should) or "failed" (a run
needs this and it is not there: the command exits 1). "skipped" says plainly that a check did not
run and why (a single process has no links to measure); it never counts as passing or failing.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from dataclasses import asdict, dataclass, field

from triax import safe_files
from triax.errors import printable

OK, WARNING, FAILED, SKIPPED = "ok", "warning", "failed", "skipped"
SEVERITY = {SKIPPED: 0, OK: 1, WARNING: 2, FAILED: 3}
SCHEMA_VERSION = 1  # the "triax_doctor" key of the JSON file: bump when a field changes meaning


@dataclass
class Check:
    name: str
    """What was checked, e.g. "store", "all-reduce 16 MiB", "snapshot dir free space"."""
    status: str
    figure: str
    """What was measured, in words and units, e.g. "42.1 MB/s (337 Mbit/s)"."""
    advice: str = ""
    """What to do when the status is not ok."""
    section: str = ""
    rank: int | None = None
    """The rank it was measured on; None for a finding about the whole job."""
    values: dict = field(default_factory=dict)
    """The figures as numbers (bytes/s, seconds, bytes), for scripts reading the JSON."""

    def __post_init__(self):
        if self.status not in SEVERITY:
            raise ValueError(f"unknown check status {self.status!r}")


def worst(checks: list[Check]) -> str:
    statuses = [check.status for check in checks if check.status != SKIPPED]
    return max(statuses, key=SEVERITY.__getitem__) if statuses else SKIPPED


def format_rate(bytes_per_second: float) -> str:
    """A transfer rate in bytes per second, with bits too (links are sold, and tc set, in bits)."""
    if bytes_per_second >= 1e9:
        text = f"{bytes_per_second / 1e9:.2f} GB/s"
    else:
        text = f"{bytes_per_second / 1e6:.1f} MB/s"
    bits = 8 * bytes_per_second
    return text + (f" ({bits / 1e9:.1f} Gbit/s)" if bits >= 1e9 else f" ({bits / 1e6:.0f} Mbit/s)")


def format_bytes(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def merge_ranks(per_rank: list[list[Check]]) -> list[Check]:
    """Every rank's checks -> the table's lines. A check with the same status on every rank is one
    line (rank 0's figure, "on all N ranks"); otherwise each rank whose status differs from rank
    0's gets a line of its own, so a bad node is named, not averaged away."""
    if len(per_rank) == 1:
        return [Check(**{**asdict(check), "rank": None}) for check in per_rank[0]]
    merged: list[Check] = []
    names = list(dict.fromkeys(check.name for checks in per_rank for check in checks))
    for name in names:
        found = [check for checks in per_rank for check in checks if check.name == name]
        first = found[0]
        if all(check.status == first.status for check in found):
            shown = Check(**{**asdict(first), "rank": None})
            if len(found) > 1:
                shown.figure += f" (rank {first.rank}'s; all {len(found)} ranks {first.status})"
            merged.append(shown)
            continue
        merged.append(first)
        merged += [check for check in found[1:] if check.status != first.status]
    return merged


def table(checks: list[Check], width: int | None = None) -> str:
    """The terminal table: status, check, figure, and under a line that is not ok, what to do."""
    width = width or min(shutil.get_terminal_size((120, 24)).columns, 160)
    name_width = min(max((len(_label(check)) for check in checks), default=10), 34)
    lines = [f"{'status':<8} {'check':<{name_width}} figure", "-" * min(width, 100)]
    for check in checks:
        text = f"{check.status:<8} {_label(check):<{name_width}} {check.figure}"
        lines += textwrap.wrap(printable(text), width, subsequent_indent=" " * (10 + name_width)) or [""]
        if check.advice and check.status in (WARNING, FAILED):
            lines += textwrap.wrap(printable(check.advice), width, initial_indent=" " * 9 + "-> ",
                                   subsequent_indent=" " * 12)
    return "\n".join(lines)


def _label(check: Check) -> str:
    return check.name if check.rank is None else f"{check.name} [rank {check.rank}]"


def summary(checks: list[Check], seconds: float) -> str:
    counts = {status: sum(check.status == status for check in checks) for status in (OK, WARNING, FAILED, SKIPPED)}
    verdict = {FAILED: "NOT READY: fix what failed before a long run", WARNING: "ready, with warnings",
               OK: "ready", SKIPPED: "nothing was checked"}[worst(checks)]
    return (f"{verdict} ({counts[OK]} ok, {counts[WARNING]} warning, {counts[FAILED]} failed, "
            f"{counts[SKIPPED]} skipped; {seconds:.0f} s)")


def document(checks: list[Check], *, world_size: int, nodes: list[dict], links: list[dict],
             seconds: float, config: dict | None) -> dict:
    """The JSON file's content (its schema is tested: tests/unit/doctor/test_doctor.py)."""
    from triax.version import __version__  # deferred: only the written report needs it

    return {"triax_doctor": SCHEMA_VERSION, "triax": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "status": worst(checks), "seconds": round(seconds, 3), "world_size": world_size,
            "nodes": nodes, "links": links, "checks": [asdict(check) for check in checks],
            "config": config}


def is_doctor_report(path: str) -> bool:
    """Whether `path` is a regular file holding a report this command wrote (it may be replaced)."""
    try:
        value = safe_files.read_json(path, max_bytes=16 * 2**20)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(value, dict) and "triax_doctor" in value


def write(path: str, content: dict) -> None:
    safe_files.write_atomic(path, json.dumps(content, indent=1, default=str) + "\n")


def rank_path(path: str, rank: int) -> str:
    """Where a rank that could not join the others writes its own report."""
    root, extension = os.path.splitext(path)
    return f"{root}.rank{rank}{extension or '.json'}"
