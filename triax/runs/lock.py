"""One job per run directory: an advisory lock on `<run_dir>/.triax.lock`, held by the job's
rank 0 from start to exit.

Two jobs on one run directory would delete each other's snapshot staging and prune each other's
snapshots. The lock is an flock: the kernel releases it when the holding process exits, however it
ends (a crash or kill -9 included), so a stale lock file never blocks the next run. The file holds
the holder's host and pid, for the message the second job prints; a job that ends (or fails to
start) removes it.
"""

from __future__ import annotations

import fcntl
import os
import socket

from triax import safe_files
from triax.errors import ConfigError

LOCK_NAME = ".triax.lock"

# Locks this process holds, by run directory: a process that builds a second Trainer on the same
# run directory (a resume in the same interpreter) is the same job, not a rival.
_held: dict[str, object] = {}


def lock_run_dir(run_dir: str) -> None:
    """Take the run directory for this job, or raise ConfigError naming the job that holds it."""
    key = os.path.realpath(run_dir)
    if key in _held:
        return
    path = os.path.join(run_dir, LOCK_NAME)
    while True:
        handle = os.fdopen(safe_files._open(path, os.O_RDWR | os.O_CREAT), "r+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = handle.read(200).strip().splitlines()
            handle.close()
            raise ConfigError(f"trainer.run_dir {run_dir!r} is in use by another triax job "
                              f"({holder[0] if holder else 'holder unknown'}); wait for it to end or choose "
                              "another trainer.run_dir") from None
        # The holder before us removes the file as it lets go (unlock_run_dir): a lock taken on
        # a file no longer at the path guards nothing, so take the file that is there now.
        if _same_file(handle.fileno(), path):
            break
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
    handle.flush()
    _held[key] = handle


def _same_file(descriptor: int, path: str) -> bool:
    try:
        status = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (status.st_dev, status.st_ino) == (held.st_dev, held.st_ino)


def unlock_run_dir(run_dir: str, remove: bool = False) -> None:
    """Release the lock; `remove` (the job is over, or its start failed) also deletes the lock
    file, unlinked while still held: a rival that opened it meanwhile finds it gone from the path
    once it gets the lock (lock_run_dir), and takes the path's new file instead."""
    handle = _held.pop(os.path.realpath(run_dir), None)
    if handle is not None:
        if remove:
            safe_files.remove_file(os.path.join(run_dir, LOCK_NAME))
        handle.close()  # closing the descriptor releases the flock
