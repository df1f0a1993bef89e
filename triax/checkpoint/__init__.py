"""Snapshots of a run (see snapshot.py for the format): shared by every door.

The door-neutral API: `save_snapshot(root, step, model, optimizer, state)` (or `start_snapshot`
for a background write), `load_latest_snapshot(root, model, optimizer)` (with fallback) and
`load_snapshot(path, model, optimizer)`; `open_snapshot(path)` is the one validating reader that
every other reader (export, generate, read_state) goes through."""

from triax.checkpoint.errors import SnapshotCorruptError, SnapshotError, SnapshotWriteError
from triax.checkpoint.reader import MANIFEST, SnapshotReader
from triax.checkpoint.rng import capture_rng_state, restore_rng_state
from triax.checkpoint.snapshot import (
    SNAPSHOT_PREFIX,
    PendingSnapshot,
    iter_model_tensors,
    latest_snapshot,
    list_snapshots,
    load_latest_snapshot,
    load_snapshot,
    open_snapshot,
    prune_snapshots,
    quarantine_snapshot,
    read_model_tensors,
    read_state,
    remove_snapshots,
    save_snapshot,
    snapshot_name,
    snapshot_step,
    start_snapshot,
)

__all__ = [
    "MANIFEST", "SNAPSHOT_PREFIX", "PendingSnapshot", "SnapshotCorruptError", "SnapshotError",
    "SnapshotReader", "SnapshotWriteError", "capture_rng_state", "iter_model_tensors", "latest_snapshot",
    "list_snapshots", "load_latest_snapshot", "load_snapshot", "open_snapshot", "prune_snapshots",
    "quarantine_snapshot", "read_model_tensors", "read_state", "remove_snapshots", "restore_rng_state",
    "save_snapshot", "snapshot_name", "snapshot_step", "start_snapshot",
]
