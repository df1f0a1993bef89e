"""The snapshot directory: room for the run's snapshots, how fast it takes them, and whether every
node writes to the same place.

Nothing is created where the run will write: the directory may not exist yet (the trainer makes
it), so the checks run in the nearest directory that does, and every probe file is removed.
"""

from __future__ import annotations

import os
import secrets
import time

from triax import safe_files
from triax.doctor.needs import RunNeeds
from triax.doctor.report import FAILED, OK, SKIPPED, WARNING, Check, format_bytes, format_rate

SECTION = "storage"
PROBE_BYTES = 64 * 2**20  # enough to get past the page cache's first burst on most disks
CHUNK_BYTES = 4 * 2**20
# A snapshot written slower than this stalls a GPU run for minutes per save (a 124M-parameter
# model's snapshot is 1.5 GB): below it the line is a warning.
SLOW_WRITE_BYTES_PER_S = 100e6


def is_remote(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def existing_directory(location: str) -> str:
    """The snapshot directory, or its nearest ancestor that exists (what the trainer will create
    it in). A link on the way is followed: the place it names is where the bytes go."""
    path = os.path.abspath(location.removeprefix("file://"))
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def space_check(needs: RunNeeds) -> Check:
    location = needs.snapshot_dir
    if is_remote(location):
        return Check("snapshot space", SKIPPED, f"{location} is remote storage: its free space is not "
                     "measurable from here", section=SECTION)
    path = location.removeprefix("file://")
    if os.path.lexists(path) and not os.path.isdir(path):
        return Check("snapshot space", FAILED, f"{path} exists and is not a directory",
                     "point trainer.snapshot_dir at a directory (or a path that does not exist yet)", SECTION)
    directory = existing_directory(location)
    try:
        info = os.statvfs(directory)
    except OSError as error:
        return Check("snapshot space", FAILED, f"cannot read {directory}: {error.strerror or error}",
                     "make trainer.snapshot_dir (or trainer.run_dir) a readable directory", SECTION)
    free = info.f_bavail * info.f_frsize
    one, kept = needs.snapshot_bytes, needs.snapshot_bytes * needs.snapshots_kept
    figure = (f"{format_bytes(free)} free in {directory}; one snapshot needs {format_bytes(one)}, "
              f"{needs.snapshots_kept} at once (keep_last + the one being written) {format_bytes(kept)}")
    values = {"free_bytes": free, "snapshot_bytes": one, "needed_bytes": kept, "directory": directory}
    if free < one:
        return Check("snapshot space", FAILED, figure, "not even one snapshot fits: free space there, or point "
                     "trainer.snapshot_dir at a larger disk", SECTION, values=values)
    if free < kept:
        return Check("snapshot space", WARNING, figure, "the run will fail when snapshots pile up: lower "
                     "trainer.keep_last, free space, or use a larger disk", SECTION, values=values)
    return Check("snapshot space", OK, figure, section=SECTION, values=values)


def write_check(needs: RunNeeds, rank: int) -> Check:
    """Write PROBE_BYTES (at most half the free space) in chunks and fsync, as a snapshot's shards
    are written and fsynced: the rate the run's saves will see, not the page cache's."""
    location = needs.snapshot_dir
    if is_remote(location):
        return Check("snapshot write", SKIPPED, f"{location} is remote storage: not measured", section=SECTION)
    directory = existing_directory(location)
    probe = os.path.join(directory, f".triax-doctor-write-{os.getpid()}-{rank}")
    try:
        info = os.statvfs(directory)
        size = max(CHUNK_BYTES, min(PROBE_BYTES, info.f_bavail * info.f_frsize // 2))
        chunk = os.urandom(CHUNK_BYTES)  # random: a compressing filesystem must not flatter the figure
        start = time.perf_counter()
        with safe_files.create_new(probe) as handle:
            written = 0
            while written < size:
                handle.write(chunk)
                written += len(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        seconds = time.perf_counter() - start
    except OSError as error:
        return Check("snapshot write", FAILED, f"cannot write in {directory}: {error.strerror or error}",
                     "snapshots will fail: free space there, fix its permissions, or choose another "
                     "trainer.snapshot_dir", SECTION, values={"directory": directory})
    finally:
        safe_files.remove_file(probe)
    rate = written / seconds
    needed = needs.snapshot_bytes / rate
    figure = f"{format_rate(rate)} with fsync ({format_bytes(written)}); one snapshot takes ~{needed:.1f} s"
    status = WARNING if rate < SLOW_WRITE_BYTES_PER_S and needed > 10 else OK
    return Check("snapshot write", status, figure, "saves will stall the run: use a faster disk for "
                 "trainer.snapshot_dir or trainer.async_save=true", SECTION,
                 values={"bytes_per_s": rate, "bytes": written, "seconds_per_snapshot": needed})


def marker_name(token: str, node: int) -> str:
    return f".triax-doctor-node-{token}-{node}"


def write_marker(needs: RunNeeds, token: str, node: int) -> str | None:
    """Leave this node's marker in the snapshot directory (its nearest existing ancestor) for the
    others to look for; returns its path, or None when it cannot be written (write_check says why)."""
    if is_remote(needs.snapshot_dir):
        return None
    path = os.path.join(existing_directory(needs.snapshot_dir), marker_name(token, node))
    try:
        with safe_files.create_new(path) as handle:
            handle.write(token.encode())
    except OSError:
        return None
    return path


def markers_seen(needs: RunNeeds, token: str, nodes: int) -> list[int]:
    directory = existing_directory(needs.snapshot_dir)
    return [node for node in range(nodes) if safe_files.is_regular(os.path.join(directory, marker_name(token, node)))]


def new_token() -> str:
    return secrets.token_hex(8)


def shared_check(needs: RunNeeds, seen_by_node: list[list[int]], node_names: list[str]) -> Check:
    """Every node must see the directory node 0 sees: rank 0 writes each snapshot's manifest, every
    rank its own shards, and a snapshot is whole only where all of them land together. A node that
    sees other markers than node 0 is named with what it misses."""
    if is_remote(needs.snapshot_dir):
        return Check("snapshot dir shared", SKIPPED, f"{needs.snapshot_dir} is remote storage, the same for "
                     "every node that can reach it", section=SECTION)
    nodes = len(seen_by_node)
    reference = set(seen_by_node[0])
    directory = existing_directory(needs.snapshot_dir)
    if reference == set(range(nodes)) and all(set(seen) == reference for seen in seen_by_node):
        return Check("snapshot dir shared", OK, f"all {nodes} nodes see the same {directory}", section=SECTION)
    blind = [node for node, seen in enumerate(seen_by_node) if set(seen) != reference or node not in reference]
    if not blind:  # node 0 alone disagrees with everyone: name it
        blind = [0]
    words = "; ".join(f"{node_names[node]} does not see what "
                      f"{', '.join(node_names[other] for other in sorted(set(range(nodes)) - set(seen_by_node[node])))} "
                      "wrote" for node in blind)
    return Check("snapshot dir shared", FAILED, f"{directory}: {words}",
                 "snapshots of a run on several nodes need one shared directory (a network filesystem) or "
                 "an fsspec URL in trainer.snapshot_dir", SECTION, values={"blind_nodes": blind})
