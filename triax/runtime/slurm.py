"""What a Slurm allocation tells a job: its nodes, where it meets, how many tasks each node runs.

srun starts every task of a step with SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (triax.runtime.place reads
them) but sets no MASTER_ADDR/MASTER_PORT. Every task must still agree on one rendezvous address
without talking to the others, so it is derived from what all of them see alike:

- the host: the first node of the step (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST). Slurm puts
  task 0 on the first node of the step under its block and cyclic distributions;
- the port: SLURM_FIRST_PORT + (SLURM_JOB_ID mod SLURM_PORT_SPAN), so two jobs sharing a node
  rarely collide and a requeued job (same id) meets on the same port as before.

Node lists are in Slurm's hostlist syntax: `node[1-3,5],login`, `gpu[01-16]`, `rack[1-2]-n[1-4]`
(brackets multiply). A list that cannot be read is one line naming it, never a guess.
"""

from __future__ import annotations

import re
from typing import Mapping

from triax.errors import TriaxError

SLURM_FIRST_PORT = 15000  # above the registered ports most daemons use, below Linux's ephemeral range (32768+)
SLURM_PORT_SPAN = 10000
# A node list longer than this is not an allocation (Slurm compresses lists: `n[1-100000]` is 12
# characters); a range wider than MAX_HOSTS is refused before anything is expanded.
MAX_NODELIST_CHARS = 1 << 20
MAX_HOSTS = 1 << 20

_NAME_CHARS = re.compile(r"^[A-Za-z0-9._-]*$")
# ASCII digits only: \d also matches other scripts' digits ('١'), which int() reads but no host has.
_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")


def _split_top_level(text: str, what: str) -> list[str]:
    """'a[1-2],b' -> ['a[1-2]', 'b']: commas outside brackets separate hosts."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise TriaxError(f"{what}: nested '[' at character {index + 1}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise TriaxError(f"{what}: ']' without '[' at character {index + 1}")
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise TriaxError(f"{what}: '[' is never closed")
    items.append(text[start:])
    return items


def _ranges(body: str, what: str) -> list[tuple[int, int, int]]:
    """'1-3,05' -> [(1, 3, width), (5, 5, 2)]: width is the zero-padded width ('01' -> 2), or 0."""
    ranges = []
    for part in body.split(","):
        match = _RANGE.match(part)
        if not match:
            raise TriaxError(f"{what}: [{body}] holds {part!r}, which is not a number or a range such as 1-4")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise TriaxError(f"{what}: the range {part} runs backwards")
        width = len(low_text) if low_text.startswith("0") and len(low_text) > 1 else 0
        ranges.append((low, high, width))
    return ranges


def _parse_item(item: str, what: str) -> list[object]:
    """'rack[1-2]-n[01-02]' -> ['rack', [(1, 2, 0)], '-n', [(1, 2, 2)], '']: text and range groups."""
    if not item:
        raise TriaxError(f"{what}: an empty host name (two commas in a row, or a comma at an end)")
    if item.startswith("-"):
        raise TriaxError(f"{what}: {item!r} starts with '-', which no host name does (it would read as an option)")
    pieces: list[object] = []
    rest = item
    while "[" in rest:
        prefix, _, rest = rest.partition("[")
        body, _, rest = rest.partition("]")
        pieces += [prefix, _ranges(body, what)]
    pieces.append(rest)
    for text in pieces[::2]:
        if not _NAME_CHARS.match(text):
            raise TriaxError(f"{what}: {item!r} holds a character a host name cannot have "
                             "(letters, digits, '.', '-', '_')")
    return pieces


def _count(pieces: list[object]) -> int:
    total = 1
    for ranges in pieces[1::2]:
        total *= sum(high - low + 1 for low, high, _ in ranges)
    return total


def _names(pieces: list[object]):
    if len(pieces) == 1:
        yield pieces[0]
        return
    prefix, ranges, rest = pieces[0], pieces[1], pieces[2:]
    for low, high, width in ranges:
        for number in range(low, high + 1):
            for tail in _names(rest):
                yield f"{prefix}{number:0{width}d}{tail}"


def _parsed(nodelist: str, source: str) -> list[list[object]]:
    what = f"{source}={nodelist[:200]!r} cannot be read as a Slurm node list"
    if len(nodelist) > MAX_NODELIST_CHARS:
        raise TriaxError(f"{source} is {len(nodelist)} characters long (at most {MAX_NODELIST_CHARS}); "
                         "it is not a Slurm node list")
    if not nodelist.strip():
        raise TriaxError(f"{source} is empty; run inside a Slurm allocation (sbatch, salloc) or set MASTER_ADDR")
    items = [_parse_item(item, what) for item in _split_top_level(nodelist.strip(), what)]
    total = sum(_count(pieces) for pieces in items)
    if total > MAX_HOSTS:
        raise TriaxError(f"{what}: it names {total} hosts (at most {MAX_HOSTS})")
    return items


def expand_nodelist(nodelist: str, source: str = "the node list") -> list[str]:
    """Every host of a Slurm node list, in order: 'node[1-2],gpu07' -> ['node1', 'node2', 'gpu07']."""
    return [name for pieces in _parsed(nodelist, source) for name in _names(pieces)]


def first_host(nodelist: str, source: str = "the node list") -> str:
    """The first host of a Slurm node list (the whole list is checked, only one name is made)."""
    return next(_names(_parsed(nodelist, source)[0]))


def tasks_per_node(text: str, source: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed counts, '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.match(r"^([0-9]+)(?:\(x([0-9]+)\))?$", part.strip())
        if not match:
            raise TriaxError(f"{source}={text[:200]!r} cannot be read (expected e.g. '2(x3),1')")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise TriaxError(f"{source}={text[:200]!r} names more than {MAX_HOSTS} nodes")
        counts += [int(match.group(1))] * repeat
    return counts


def job_id(env: Mapping[str, str]) -> int | None:
    text = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise TriaxError(f"SLURM_JOB_ID={text[:40]!r} is not a job number")
    return int(text)


def rendezvous_port(env: Mapping[str, str]) -> int:
    """The port every task of the job derives alike from its id (see the module's docstring)."""
    number = job_id(env)
    if number is None:
        raise TriaxError("SLURM_JOB_ID is not set, so no rendezvous port can be derived; set MASTER_PORT")
    return SLURM_FIRST_PORT + number % SLURM_PORT_SPAN


def rendezvous_address(env: Mapping[str, str]) -> tuple[str, int, str]:
    """(host, port, how) where the tasks of this Slurm step meet; `how` says where each came from."""
    source = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    nodelist = env.get(source)
    if nodelist is None:
        raise TriaxError("neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set, so the job's first node is "
                         "unknown; set MASTER_ADDR (and MASTER_PORT) to where rank 0 runs")
    host = first_host(nodelist, source)
    port = rendezvous_port(env)
    return host, port, f"{host} (first node of {source}) port {port} (from SLURM_JOB_ID)"


def _ascii_digits(text: str) -> bool:
    """0-9 only: str.isdigit() also accepts other scripts' digits ('١'), which int() reads."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def local_world_size(env: Mapping[str, str]) -> int | None:
    """Tasks of this step on this node (SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID), or None."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not text or node is None or not _ascii_digits(node):
        return None
    counts = tasks_per_node(text)
    return counts[int(node)] if int(node) < len(counts) else None


def launch_placement(env: Mapping[str, str]) -> dict:
    """For `triax launch` (torchrun, one agent per node) inside an srun step: the number of machines,
    this machine's rank and machine 0's address, as LaunchConfig fields; {} outside a step.
    MASTER_ADDR/MASTER_PORT, when set (torchtitan's scripts set them), are machine 0's address."""
    if "SLURM_STEP_ID" not in env or "SLURM_NODEID" not in env:
        return {}
    source = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    counts = tasks_per_node(env.get(source) or "1", source)
    if any(count != 1 for count in counts):
        raise TriaxError(f"triax launch starts torchrun's agent once per node, but this srun step runs "
                         f"{source}={env.get(source)} tasks per node; use srun --ntasks-per-node=1 (the agent "
                         "starts --num-processes workers on each node)")
    node = env["SLURM_NODEID"]
    if not _ascii_digits(node) or int(node) >= len(counts):
        raise TriaxError(f"SLURM_NODEID={node[:40]!r} is not a node of this step ({len(counts)} nodes)")
    host, port, _ = rendezvous_address(env)
    if env.get("MASTER_PORT"):
        given = env["MASTER_PORT"]
        if not _ascii_digits(given) or not 1 <= int(given) <= 65535:
            raise TriaxError(f"MASTER_PORT={given[:40]!r} is not a port; set it to a number from 1 to 65535 "
                             "(or unset it: the port is derived from SLURM_JOB_ID)")
        port = int(given)
    return {"num_machines": len(counts), "machine_rank": int(node), "main_process_ip": env.get("MASTER_ADDR") or host,
            "main_process_port": port}


def allocation_hosts(env: Mapping[str, str]) -> list[tuple[str, int]] | None:
    """Inside an allocation (sbatch, salloc): its nodes with the tasks it asked for on each, as
    `triax horovodrun` host entries ('node1', 2); None outside one. One slot per node when the
    task counts do not describe every node."""
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist or not (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")):
        return None
    hosts = expand_nodelist(nodelist, "SLURM_JOB_NODELIST")
    counts = tasks_per_node(env["SLURM_TASKS_PER_NODE"], "SLURM_TASKS_PER_NODE") if env.get("SLURM_TASKS_PER_NODE") else []
    if len(counts) != len(hosts):
        counts = [1] * len(hosts)
    return list(zip(hosts, counts))


def step_command(host: str, argv: list[str]) -> list[str]:
    """`argv` started on `host` of this allocation as a job step of one task (what ssh does outside
    Slurm; clusters often refuse ssh to compute nodes, and a step is tracked, signalled and
    cleaned up by Slurm). --overlap: the step may share CPUs the job's other steps hold."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--kill-on-bad-exit=1", *argv]
