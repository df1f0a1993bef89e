"""Lifecycle and topology: `hvd.init()`, `hvd.rank()`, `hvd.size()` and friends.

Horovod keeps its own MPI/Gloo world; here the world is torch.distributed's default process group,
found through `triax.place` (torchrun, `triax launch`, mpirun, Horovod's variables, Slurm).
`init()` may be called again after `shutdown()`; every answer below is recomputed each time.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from triax.horovod.errors import HorovodTypeError, HorovodValueError
from triax.place import detect_place, pick_device
from triax.process_group import init_distributed
from triax.rendezvous import attempt_store, set_rendezvous_defaults
from triax.timeouts import collective_timeout

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
# The rendezvous store outlives shutdown(): every init() after the first joins under a new key
# prefix on the same store. A fresh env:// rendezvous would race (a fast rank could reach the
# previous store, or read the previous group's keys) and hang.
_base_store = None
_generation = 0


def _check_from_env() -> bool:
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _backend_for(device: torch.device) -> str:
    # Horovod scripts mix GPU tensors (gradients) and CPU tensors (metrics, objects) in collectives;
    # one group with a backend per device type serves both.
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init(comm=None, process_sets=None, check: bool | None = None) -> None:
    """Join the job. `process_sets`: hvd.ProcessSet objects to register, in order, on every rank
    ("dynamic" or None: none now; add them later with hvd.add_process_set). `check` turns the disagreement check on or off
    (default: on, unless TRIAX_HOROVOD_CHECK=0)."""
    global _world
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise HorovodTypeError("hvd.init(comm=...) takes an MPI communicator in Horovod; triax has no MPI "
                         "layer: call hvd.init() and start the processes with mpirun or torchrun")
    if comm:
        raise HorovodValueError(f"hvd.init(comm={comm!r}): sub-communicators are not supported; call hvd.init()")
    if _world is not None:
        return  # Horovod allows repeated init(); the second call changes nothing
    place = detect_place()
    # The device Horovod scripts pin themselves (torch.cuda.set_device(hvd.local_rank())) is the
    # one we pick too, so NCCL binds to the same GPU.
    device = pick_device("cuda" if torch.cuda.is_available() else "cpu", place.local_rank)
    owns_group = not dist.is_initialized()
    if place.world_size > 1 or dist.is_initialized():
        store = _next_store(place) if owns_group and place.world_size > 1 else None
        place = init_distributed(device, place, backend=_backend_for(device), store=store, timeout_s=_gloo_timeout())
    rank, size = place.rank, place.world_size
    local_rank, local_size = place.local_rank, place.local_world_size
    cross_rank, cross_size, homogeneous = 0, 1, True
    if size > 1:
        # Horovod's cross communicator joins the ranks with the same local rank, one per node.
        mine = [socket.gethostname(), local_rank, local_size]
        everyone: list = [None] * size
        dist.all_gather_object(everyone, mine)
        same_local = [r for r, entry in enumerate(everyone) if entry[1] == local_rank]
        cross_rank, cross_size = same_local.index(rank), len(same_local)
        homogeneous = len({entry[2] for entry in everyone}) == 1
    _world = _World(rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous, device,
                    _check_from_env() if check is None else bool(check), owns_group)
    # Scripts written for horovodrun read these.
    os.environ.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(size),
                      HOROVOD_LOCAL_RANK=str(local_rank), HOROVOD_LOCAL_SIZE=str(local_size),
                      HOROVOD_CROSS_RANK=str(cross_rank), HOROVOD_CROSS_SIZE=str(cross_size))
    from triax.horovod import process_sets as sets

    sets.register_at_init(process_sets)


def _gloo_timeout() -> float | None:
    """Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS bounds every collective; unset: triax's default
    (triax.timeouts.process_group_timeout)."""
    text = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = text
    return collective_timeout(value, source="HOROVOD_GLOO_TIMEOUT_SECONDS")


def _next_store(place):
    global _base_store, _generation
    if _base_store is None:
        set_rendezvous_defaults()
        _base_store, _, _ = next(dist.rendezvous("env://", place.rank, place.world_size))
    _generation += 1
    # A fresh prefix per init() (generation) and per torchrun restart attempt (triax.rendezvous.attempt_store).
    return attempt_store(_base_store, f"triax-horovod/{_generation}")


def shutdown() -> None:
    """Leave the job; `init()` may be called again afterwards."""
    global _world
    if _world is None:
        return
    from triax.horovod import handles

    from triax.horovod import process_sets

    handles.forget_all()
    process_sets.forget_all()
    if _world.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _world = None


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


def start_timeline(file_path, mark_cycles: bool = False) -> None:
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
