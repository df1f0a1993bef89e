"""The one way triax opens files inside a run or output directory it does not fully own.

Run directories, data directories and export targets are user-writable, so any name in them may
have been replaced by a symlink (pointing out of the directory), a FIFO (a reader would block
forever) or a huge sparse file (a reader would allocate it whole). Every open here:
- never follows a symlink in the last component (O_NOFOLLOW) and refuses a directory given
  through a symlink (`real_directory`), so nothing is read or written outside the directory;
- opens without blocking (O_NONBLOCK) and then requires a regular file (fstat), so a FIFO or a
  device is refused at once;
- reads metadata files only up to a size cap, checked before reading.
Writes go to a new temporary file (O_EXCL) in the same directory, fsynced, then renamed over the
final name: a rename replaces a planted link itself, never its target, and a full disk leaves
the previous file (or none) instead of an empty one.
"""

from __future__ import annotations

import json
import os
import stat

from triax.errors import TriaxError

# Metadata files (model.json, vocab.json, meta.json, shards.json, state.json, config.yaml, a
# tokenizer) are kilobytes to a few megabytes; a larger one is damaged, not read whole.
MAX_METADATA_BYTES = 64 * 2**20


class UnsafeFileError(TriaxError, OSError):
    """A path that triax would read or write is a symlink, a FIFO, a device, a directory where a
    file belongs, or larger than a metadata file can be."""


def real_directory(path: str) -> str:
    """`path` itself, after checking it is a directory and not a symlink to one (a symlinked run
    or output directory would send every write elsewhere)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise UnsafeFileError(f"{path} does not exist") from None
    if stat.S_ISLNK(mode):
        raise UnsafeFileError(f"{path} is a symlink; triax writes only into a real directory "
                              "(remove the link or point at its target directly)")
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(f"{path} is not a directory")
    return path


def make_directory(path: str) -> str:
    """Create `path` (and its parents) if missing; refuse it if it is a symlink or not a directory.
    A place that cannot be made (a parent that is a file, a read-only or kernel filesystem, a name
    too long) is one line naming it and why, not the OSError of the one component that failed."""
    if not os.path.lexists(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as error:
            raise UnsafeFileError(f"cannot make the directory {path!r}: {error.strerror or error}; "
                                  "give a place where a directory can be made") from None
    return real_directory(path)


# Kernel filesystems: their directories look writable to root, but a directory made there (if one
# can be) holds no files; an output place under them is a slip, refused before anything is read.
KERNEL_FILESYSTEMS = ("/proc", "/sys")
# POSIX's least limits, used where the filesystem does not say its own (pathconf).
NAME_MAX, PATH_MAX = 255, 4096


def _limit(directory: str, name: str, default: int) -> int:
    try:
        return os.pathconf(directory, name)
    except (OSError, ValueError):
        return default


def _why_not(path: str, directory: bool) -> str | None:
    """Why `path` cannot become (or be) the directory (or file) an output is written to, or None."""
    if not path.strip():
        return "the name is empty"
    if "\0" in path:
        return "the name holds a NUL character"
    absolute = os.path.abspath(path)
    existing = absolute
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    real = os.path.realpath(existing)
    if any(real == root or real.startswith(root + os.sep) for root in KERNEL_FILESYSTEMS):
        return f"{real} is on a kernel filesystem, not storage"
    if existing == absolute:
        if directory and not os.path.isdir(absolute):
            return "it is a file, not a directory" if is_regular(absolute) else "it exists and is not a directory"
        if not directory and os.path.isdir(absolute):
            return "it is a directory, not a file"
    elif not os.path.isdir(existing):
        return f"{existing} is a file, not a directory" if is_regular(existing) else f"{existing} is not a directory"
    name_max = _limit(existing if os.path.isdir(existing) else "/", "PC_NAME_MAX", NAME_MAX)
    missing = [part for part in absolute[len(existing):].split(os.sep) if part]
    too_long = [part for part in missing if len(os.fsencode(part)) > name_max]
    if too_long or len(os.fsencode(absolute)) >= _limit("/", "PC_PATH_MAX", PATH_MAX):
        return f"the name {(too_long or [absolute])[0][:40]}... is longer than the filesystem allows"
    writable = existing if existing != absolute or directory else os.path.dirname(existing)
    try:
        read_only = bool(os.statvfs(writable).f_flag & os.ST_RDONLY)
    except OSError as error:
        return f"{writable} cannot be examined ({error.strerror})"
    if read_only or not os.access(writable, os.W_OK | os.X_OK):
        return f"{writable} is read-only" if read_only else f"{writable} is not writable by this user"
    return None


def check_output_place(option: str, path: str, directory: bool = True) -> None:
    """Refuse, in one line naming it and why, an output place that cannot be made or written (a
    parent that is a file, a read-only or kernel filesystem, a name empty or too long), without
    making anything: every command checks its output this way before any expensive read."""
    why = _why_not(path, directory)
    if why is not None:
        kind = "directory" if directory else "file"
        shown = path if len(path) <= 100 else path[:100] + "..."
        raise UnsafeFileError(f"{option} {shown!r} cannot be written as a {kind}: {why}; give another place")


def _regular(descriptor: int, path: str, max_bytes: int | None) -> None:
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(f"{path} is not a regular file (a FIFO, device or directory); "
                              "replace it with the file triax expects")
    if max_bytes is not None and info.st_size > max_bytes:
        raise UnsafeFileError(f"{path} is {info.st_size} bytes, more than the {max_bytes} a file of its "
                              "kind can hold; it is damaged or not the file triax wrote")


def _open(path: str, flags: int, max_bytes: int | None = None) -> int:
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as error:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise error from None
        if stat.S_ISLNK(mode):
            raise UnsafeFileError(f"{path} is a symlink; triax does not follow links in a run or output "
                                  "directory (remove the link)") from None
        if not stat.S_ISREG(mode):  # a FIFO without a reader refuses a non-blocking writer (ENXIO)
            raise UnsafeFileError(f"{path} is not a regular file (a FIFO, device or directory); "
                                  "replace it with the file triax expects") from None
        raise
    try:
        _regular(descriptor, path, max_bytes)
        os.set_blocking(descriptor, True)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def open_read(path: str, max_bytes: int | None = None, binary: bool = True):
    """Open an existing regular file for reading (no link, no FIFO, at most `max_bytes`)."""
    descriptor = _open(path, os.O_RDONLY, max_bytes)
    return os.fdopen(descriptor, "rb") if binary else os.fdopen(descriptor, "r", encoding="utf-8")


def read_bytes(path: str, max_bytes: int = MAX_METADATA_BYTES) -> bytes:
    with open_read(path, max_bytes) as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while we read it
        raise UnsafeFileError(f"{path} is more than {max_bytes} bytes; it is damaged")
    return data


def read_text(path: str, max_bytes: int = MAX_METADATA_BYTES) -> str:
    return read_bytes(path, max_bytes).decode("utf-8")


def read_json(path: str, max_bytes: int = MAX_METADATA_BYTES):
    """JSON without NaN or Infinity (not JSON, and never a valid value in a triax file)."""
    return json.loads(read_text(path, max_bytes), parse_constant=_no_constant)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number triax accepts")


def is_regular(path: str) -> bool:
    """Whether `path` is a regular file itself (not through a symlink)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_directory(path: str) -> bool:
    """Whether `path` is a directory itself (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_append(path: str):
    """Append to a regular file, creating it if missing; never through a link, never to a FIFO.
    Text mode, line-buffered (a log)."""
    descriptor = _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(descriptor, "a", buffering=1, encoding="utf-8")


def open_write(path: str, append: bool = False):
    """A regular file to write bytes to, created if missing, emptied first unless `append`; never
    through a link, never to a FIFO or a device (refused at once, not waited on)."""
    descriptor = _open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0))
    try:
        if not append:  # emptied only once known to be this file alone (not a hard link to another)
            if os.fstat(descriptor).st_nlink > 1:
                raise UnsafeFileError(f"{path} has other hard links; triax does not empty a file shared with "
                                      "another name (remove it)")
            os.ftruncate(descriptor, 0)
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "ab" if append else "wb")


def create_new(path: str, binary: bool = True):
    """Create a file that must not exist yet (never follows a planted link, never truncates)."""
    descriptor = _open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    return os.fdopen(descriptor, "wb") if binary else os.fdopen(descriptor, "w", encoding="utf-8")


def write_atomic(path: str, data: bytes | str) -> None:
    """Replace `path` with `data`: a fresh temporary file in the same directory, fsynced, renamed
    over the final name. A symlink at `path` is replaced, its target untouched; a directory at
    `path` is refused."""
    if is_directory(path):
        raise UnsafeFileError(f"{path} is a directory; triax writes a file there")
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(path) or "."
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    remove_file(temporary)
    try:
        with create_new(temporary) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        remove_file(temporary)
        raise


def remove_file(path: str) -> None:
    """Unlink a file or link if present (a link's target is untouched); leave directories alone."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def stored_bytes(path: str) -> int:
    """Bytes a regular file really occupies on disk: a sparse file claims more than it holds."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return 0
    blocks = getattr(info, "st_blocks", None)
    return info.st_size if blocks is None else min(info.st_size, blocks * 512)


def read_location(location: str, max_bytes: int = MAX_METADATA_BYTES) -> bytes:
    """A metadata file at a local path (the checks above) or an fsspec URL (read at most
    `max_bytes` + 1 bytes, so a huge remote file is refused too)."""
    if "://" not in location or location.startswith("file://"):
        return read_bytes(location.removeprefix("file://"), max_bytes)
    import fsspec  # deferred: only remote data needs it

    with fsspec.open(location, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafeFileError(f"{location} is more than {max_bytes} bytes; it is damaged")
    return data
