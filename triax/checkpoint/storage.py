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

import fsspec
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import save as save_tensors_to_bytes
from safetensors.torch import save_file as save_tensors_to_file


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str) -> tuple[int, str]:
    """(size, sha256) of a local file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(16 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


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
        return os.path.exists(path) if self.local else self.fs.exists(path)

    def makedirs(self, path: str) -> None:
        if self.local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def write(self, path: str, data: bytes) -> None:
        """Write `data` to `path` durably (local: flushed and fsynced before returning)."""
        if self.local:
            with open(path, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        else:
            self.fs.pipe_file(path, data)

    def write_tensors(self, path: str, tensors: dict) -> tuple[int, str]:
        """Write `tensors` as safetensors; returns (size in bytes, sha256). Locally safetensors
        writes the file itself (no second in-memory copy of a multi-GB model), then it is fsynced
        and hashed from the page cache."""
        if not self.local:
            data = save_tensors_to_bytes(tensors)
            self.write(path, data)
            return len(data), sha256(data)
        save_tensors_to_file(tensors, path)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        return file_sha256(path)

    def read(self, path: str) -> bytes:
        if self.local:
            with open(path, "rb") as handle:
                return handle.read()
        return self.fs.cat_file(path)

    def remove_tree(self, path: str) -> None:
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
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
