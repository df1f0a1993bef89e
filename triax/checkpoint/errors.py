"""The snapshot errors (a module of their own so the reader and the writer share them)."""

from triax.errors import TriaxError


class SnapshotError(TriaxError, RuntimeError):
    """A snapshot could not be written or read."""


class SnapshotWriteError(SnapshotError):
    """Writing failed (unwritable or full storage). Earlier snapshots are untouched."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot is incomplete, fails its checksums, or holds something triax did not write."""
