"""The snapshot errors (a module of their own so the reader and the writer share them)."""

from triax.errors import TriaxError


class SnapshotError(TriaxError, RuntimeError):
    """A snapshot could not be written or read."""


class SnapshotWriteError(SnapshotError):
    """Writing failed (unwritable or full storage). Earlier snapshots are untouched. `retryable`:
    whether the cause is the storage's (an OSError: full, unwritable, unreachable), which a later
    attempt may find fixed; any other failure (a missing module, a value that is not JSON) would
    fail the same way again."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class SnapshotCorruptError(SnapshotError):
    """A snapshot is incomplete, fails its checksums, or holds something triax did not write."""
