"""Where snapshot bytes go: a local directory or any fsspec URL (memory://, s3://, gs://, ...).

Local files are made durable the POSIX way: written, flushed and fsynced, and a snapshot directory
is renamed to its final name only when complete, so a crash leaves either the old state or the new
one, never a half-written file under a final name. Object stores have no rename; there a snapshot
is complete once its manifest (written last) exists.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from triax import safe_files


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_regular(path: str):
    """Open a local snapshot file for reading: a regular file only, never through a symlink (it
    could point out of the run directory), and a FIFO or device never blocks the reader."""
    return safe_files.open_read(path)


def create_new(path: str):
    """Create a local file that must not exist yet (never follows a planted symlink)."""
    return safe_files.create_new(path)


def is_real_directory(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_entry(path: str) -> None:
    """Remove whatever is at `path` without following it: a symlink is unlinked (its target is
    untouched), a directory deleted with its contents (rmtree does not follow links inside)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class Store:
    """A snapshot root directory, local or behind fsspec."""

    def __init__(self, root: str):
        self.url = root
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.local = isinstance(self.fs, LocalFileSystem)

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts) if self.local else "/".join([base.rstrip("/"), *parts])

    def path(self, *parts: str) -> str:
        """A path under the root."""
        return self.join(self.root, *parts)

    def url_of(self, path: str) -> str:
        """A string that `Store(...)` and the user can open again: plain path locally, URL otherwise."""
        return path if self.local else self.fs.unstrip_protocol(path)

    def names(self) -> list[str]:
        """Entries directly under the root (names only); empty if the root does not exist."""
        if self.local:
            return sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path) if self.local else self.fs.exists(path)

    def is_directory(self, path: str) -> bool:
        """A real directory (locally: not a symlink to one)."""
        return is_real_directory(path) if self.local else self.fs.isdir(path)

    def size(self, path: str) -> int:
        """Size of a regular file (locally: refuses symlinks, FIFOs and devices)."""
        if self.local:
            mode = os.lstat(path)
            if not stat.S_ISREG(mode.st_mode):
                raise OSError(f"{path} is not a regular file")
            return mode.st_size
        return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        if self.local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def write(self, path: str, data: bytes) -> None:
        """Write `data` to `path` durably (local: flushed and fsynced before returning)."""
        if self.local:
            with create_new(path) as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        else:
            self.fs.pipe_file(path, data)

    def read(self, path: str, limit: int | None = None) -> bytes:
        """The bytes of a file; at most `limit` + 1 of them, so a caller that knows the size to
        expect can tell a longer file without reading all of it."""
        if self.local:
            with open_regular(path) as handle:
                return handle.read(-1 if limit is None else limit + 1)
        if limit is None:
            return self.fs.cat_file(path)
        with self.fs.open(path, "rb") as handle:
            return handle.read(limit + 1)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """`length` bytes from `offset` (fewer if the file is shorter)."""
        if self.local:
            with open_regular(path) as handle:
                handle.seek(offset)
                return handle.read(length)
        return self.fs.cat_file(path, start=offset, end=offset + length)

    def flush_and_sync(self, handle: IO[bytes]) -> None:
        """Make what was written to a stream from open_new durable (object stores: on close)."""
        if self.local:
            handle.flush()
            os.fsync(handle.fileno())

    def open_new(self, path: str):
        """A writable binary stream for a new file."""
        return create_new(path) if self.local else self.fs.open(path, "wb")

    def remove_tree(self, path: str) -> None:
        if self.local:
            remove_entry(path)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def sync_directory(self, path: str) -> None:
        """fsync a directory so the names in it (a rename, a new file) survive a power cut."""
        if not self.local:
            return
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def rename(self, source: str, target: str) -> None:
        """Local only: atomically give a complete directory its final name."""
        os.replace(source, target)
        self.sync_directory(os.path.dirname(target) or ".")
