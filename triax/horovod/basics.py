"""Topology and capabilities: `hvd.rank()`, `hvd.size()` and friends, from what `hvd.init()`
learned (lifecycle.py joins the job and records it here with set_world).

Horovod keeps its own MPI/Gloo world; here the world is torch.distributed's default process group.
`init()` may be called again after `shutdown()`; every answer below is recomputed each time.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from triax.horovod.errors import HorovodValueError

CHECK_ENV = "TRIAX_HOROVOD_CHECK"


@dataclass
class _World:
    """What init() learned; replaced on every init()."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    device: torch.device
    check: bool  # the disagreement check before each collective
    owns_group: bool  # we created the process group, so shutdown() destroys it


_world: _World | None = None


def set_world(world: _World | None) -> None:
    """lifecycle.init() and shutdown() record (or clear) what init learned."""
    global _world
    _world = world


def is_initialized() -> bool:
    return _world is not None


def world() -> _World:
    if _world is None:
        raise HorovodValueError("Horovod has not been initialized; use hvd.init() first")
    return _world


def size() -> int:
    return world().size


def rank() -> int:
    return world().rank


def local_size() -> int:
    return world().local_size


def local_rank() -> int:
    return world().local_rank


def cross_size() -> int:
    return world().cross_size


def cross_rank() -> int:
    return world().cross_rank


def is_homogeneous() -> bool:
    return world().homogeneous


def set_disagreement_check(enabled: bool) -> None:
    """Turn the metadata check before each collective on or off (must match on every rank)."""
    world().check = bool(enabled)


def disagreement_check_enabled() -> bool:
    return world().check


def is_distributed() -> bool:
    return world().size > 1


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod writes a Chrome-trace timeline; triax does not. Use torch.profiler instead."""
    world()
    warnings.warn(f"hvd.start_timeline({file_path!r}) does nothing in triax.horovod; record a trace with "
                  "torch.profiler.profile(...) instead", stacklevel=2)


def stop_timeline() -> None:
    world()
    warnings.warn("hvd.stop_timeline() does nothing in triax.horovod (no timeline is recorded)", stacklevel=2)


# Capability queries, answered for what triax actually runs on.
def mpi_built() -> bool:
    return False  # triax never links MPI; mpirun only starts the processes


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    return gloo_built() and is_initialized() and (not is_distributed() or "gloo" in str(dist.get_backend()))


def nccl_built() -> bool:
    return dist.is_available() and dist.is_nccl_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None
