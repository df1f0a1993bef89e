"""Environment variables and the host: Accelerate's helpers for them, under its names
(re-exported by triax.accelerate.utils)."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import socket
from typing import Any

from packaging.version import Version

from triax.accelerate._internal.flags import (  # noqa: F401 - Accelerate's names, here too
    parse_flag_from_env,
    str_to_bool,
)
from triax.accelerate.state import PartialState

logger = logging.getLogger(__name__)

# Linux kernels before this one can hang a process (Accelerate's issue #1929); check_os_kernel warns.
MINIMUM_KERNEL = "5.5.0"


def parse_choice_from_env(key: str, default: str = "no") -> str:
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: str | list[str], default: Any):
    """The first of the variables `env_keys` that holds a non-negative integer, else `default`."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


@contextlib.contextmanager
def patch_environment(**kwargs: Any):
    """Set the variables (names upper-cased, values as strings) inside the block; on leaving, even
    by an exception, each is back to its earlier value or unset again."""
    patched = {key.upper(): str(value) for key, value in kwargs.items()}
    before = {key: os.environ.get(key) for key in patched}
    os.environ.update(patched)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment():
    """An empty environment inside the block; the earlier one is back on leaving (even by an
    exception), whatever the block set."""
    before = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def check_os_kernel() -> None:
    """Warn (through logging) when this Linux kernel is older than MINIMUM_KERNEL."""
    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"\d+\.\d+\.\d+", info.release)
    if found is None or Version(found.group()) >= Version(MINIMUM_KERNEL):
        return
    if PartialState._shared_state.get("_initialized") and not PartialState().is_main_process:
        return
    logger.warning(f"Detected kernel version {found.group()}, below the recommended minimum of {MINIMUM_KERNEL}: "
                   "processes can hang on it; upgrade the kernel to that version or later")


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on `port` (torchrun's default, 29500, if None) on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", 29500 if port is None else port)) == 0
