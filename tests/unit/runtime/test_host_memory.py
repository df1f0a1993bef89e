"""The trainer's processes give large freed buffers back to the operating system (glibc's
malloc would otherwise keep them in its heap, and a rank's memory would stay at its step-time
high), and leave a user's own allocator settings alone."""

import json
import os
import sys

import pytest

from triax.runtime.host_memory import glibc_version
from triax.testing import quiet_env, run

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not sys.platform.startswith("linux") or not glibc_version(),
                                 reason="the setting is for glibc's malloc on Linux")]

# 256 MiB in 8 MiB buffers, half of them freed; 8 MiB is under glibc's largest dynamic threshold (32 MiB)
BLOCKS, BLOCK_MB = 32, 8

# Frees one large buffer first (as a training step does: glibc then raises its mmap threshold
# above that size), then allocates and touches buffers of that size, frees every other one (the
# live ones beside them keep glibc from trimming the freed ones off the top of its heap), and
# reports resident memory before, at the peak, and after.
CHILD = """
import json, sys
import torch
from triax.runtime.host_memory import return_freed_memory_to_os

def rss():
    with open('/proc/self/statm') as handle:
        return int(handle.read().split()[1]) * 4096

tuned = return_freed_memory_to_os() if sys.argv[1] == 'tune' else None
blocks, size = int(sys.argv[2]), int(sys.argv[3]) << 20
first = torch.ones(size // 4)
del first
before = rss()
buffers = [torch.ones(size // 4) for _ in range(blocks)]
peak = rss()
del buffers[::2]
print(json.dumps({'tuned': tuned, 'before': before, 'peak': peak, 'after': rss()}))
"""


def retained_fraction(mode, **env):
    child_env = quiet_env(**env)
    for name in list(child_env):  # the run's own allocator variables would decide the outcome
        if (name.startswith("MALLOC_") or name == "GLIBC_TUNABLES") and name not in env:
            del child_env[name]
    result = json.loads(run([sys.executable, "-c", CHILD, mode, str(BLOCKS), str(BLOCK_MB)], env=child_env,
                            timeout=120).stdout.strip().splitlines()[-1])
    allocated = BLOCKS * BLOCK_MB << 20
    assert result["peak"] - result["before"] > 0.9 * allocated, result  # the buffers were really resident
    freed = allocated // 2
    return result["tuned"], (result["after"] - result["before"] - (allocated - freed)) / freed


def test_freed_buffers_go_back_to_the_os_and_a_users_setting_wins():
    tuned, retained = retained_fraction("tune")
    assert tuned is True
    assert retained < 0.1, f"{retained:.0%} of the freed buffers stayed resident"
    # Without the setting glibc keeps them: the measurement above can fail.
    _, retained = retained_fraction("plain")
    assert retained > 0.5, f"only {retained:.0%} stayed resident without the setting"
    # A user's own threshold (32 MiB: these buffers stay in the heap) is left as it is.
    tuned, retained = retained_fraction("tune", MALLOC_MMAP_THRESHOLD_=str(32 << 20))
    assert tuned is False and retained > 0.5, (tuned, retained)
    tuned, retained = retained_fraction("tune", GLIBC_TUNABLES=f"glibc.malloc.mmap_threshold={32 << 20}")
    assert tuned is False and retained > 0.5, (tuned, retained)
