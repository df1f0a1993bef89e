"""Snapshots of a run (see snapshot.py for the format): shared by every door. The trainer saves
and resumes with them; the Accelerator's save_state/load_state call the same functions."""

from triax.checkpoint.rng import capture_rng_state, restore_rng_state
from triax.checkpoint.snapshot import (
    MANIFEST,
    SNAPSHOT_PREFIX,
    WRITE_DELAY_ENV,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotWriteError,
    latest_snapshot,
    list_snapshots,
    load_latest_snapshot,
    load_snapshot,
    prune_snapshots,
    quarantine_snapshot,
    read_model_tensors,
    read_state,
    remove_snapshots,
    save_snapshot,
    snapshot_name,
    snapshot_step,
)

__all__ = [
    "MANIFEST", "SNAPSHOT_PREFIX", "WRITE_DELAY_ENV", "SnapshotCorruptError", "SnapshotError",
    "SnapshotWriteError", "capture_rng_state", "latest_snapshot", "list_snapshots",
    "load_latest_snapshot", "load_snapshot", "prune_snapshots", "quarantine_snapshot",
    "read_model_tensors", "read_state", "remove_snapshots", "restore_rng_state", "save_snapshot",
    "snapshot_name", "snapshot_step",
]
