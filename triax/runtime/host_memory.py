"""Host memory: give freed tensor buffers back to the operating system (glibc's allocator)."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping

# Buffers of at least this many bytes get pages of their own (mmap) and go back to the OS on free.
HOST_MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
# The user's own settings of the same knobs, which we leave alone.
_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_ALLOCATOR_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad",
                       "glibc.malloc.mmap_max")
_host_allocator_tuned: bool | None = None


def return_freed_memory_to_os(env: Mapping[str, str] | None = None) -> bool:
    """Make glibc's malloc hand buffers of 4 MiB and more back to the OS when they are freed.

    Why: glibc mmaps a large block only until one such block is freed; then it raises its mmap
    threshold (up to 32 MiB) and serves later blocks of that size from the heap, which it keeps
    when they are freed. A training step allocates and frees many such blocks (FSDP's all-gathered
    parameters and unsharded gradients, activations), so a rank's resident memory stayed at its
    step-time high and every later phase (a snapshot, the next step) started from there: with FSDP
    x 4 that was most of the gap between a rank's peak and its shard of the state. A fixed
    threshold keeps each large buffer in its own mapping, returned on free (one mmap/munmap and
    fresh zeroed pages per buffer: the step-time cost the README measures). Smaller allocations
    stay in the heap as before.

    Done once per process, before the model is built; nothing on other C libraries, and nothing
    when the user already tuned glibc through MALLOC_*_ variables or GLIBC_TUNABLES's malloc
    settings (theirs win). Returns whether the setting is in force from this call.
    """
    global _host_allocator_tuned
    env = os.environ if env is None else env
    if _host_allocator_tuned is not None:
        return _host_allocator_tuned
    _host_allocator_tuned = False
    tunables = env.get("GLIBC_TUNABLES", "")
    if any(name in env for name in _ALLOCATOR_ENV) or any(name in tunables for name in _ALLOCATOR_TUNABLES):
        return False
    if not sys.platform.startswith("linux") or not glibc_version():
        return False  # musl, macOS, Windows: their allocators behave otherwise; leave them be
    try:
        libc = ctypes.CDLL("libc.so.6")
        _host_allocator_tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD))
    except (OSError, AttributeError):  # a glibc without the usual soname or symbol: leave it as it is
        pass
    return _host_allocator_tuned


def glibc_version() -> str:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; unknown name off glibc
    except (ValueError, OSError):
        return ""


# Where a container's memory limit is (cgroup v2, then v1); "max" or a huge number means none.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int | None:
    """The memory this host gives its processes: physical memory, or the container's limit when
    that is lower; None where neither can be read (not Linux)."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            sizes.append(int(text))
    return min(sizes) if sizes else None
