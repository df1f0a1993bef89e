"""`hvd.init()` and `hvd.shutdown()`: joining and leaving the job.

The world is torch.distributed's default process group, found through `triax.runtime.place` (torchrun,
`triax launch`, mpirun, Horovod's variables, Slurm). This module sits above everything it sets up
or tears down: the world (basics), the process sets and their agreement (set_registration) and
the handles in flight.
"""

from __future__ import annotations

import atexit
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from triax.horovod import basics, handles, optimizer, process_sets, set_registration
from triax.horovod.basics import CHECK_ENV
from triax.horovod.errors import HorovodTypeError, HorovodValueError
from triax.horovod.process_sets import ProcessSet
from triax.horovod.elastic import worker as elastic_worker
from triax.runtime.place import Place, detect_place, pick_device
from triax.runtime.process_group import init_distributed, shutdown_distributed
from triax.runtime.rendezvous import attempt_store, port_taken_explained, set_rendezvous_defaults
from triax.runtime.timeouts import ENV_COLLECTIVE_TIMEOUT, HOROVOD_GLOO_TIMEOUT_S, collective_timeout

# The rendezvous store outlives shutdown(): every init() after the first joins under a new key
# prefix on the same store. A fresh env:// rendezvous would race (a fast rank could reach the
# previous store, or read the previous group's keys) and hang.
_base_store = None
_generation = 0
_shutdown_registered = False


def _check_from_env() -> bool:
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _backend_for(device: torch.device) -> str:
    # Horovod scripts mix GPU tensors (gradients) and CPU tensors (metrics, objects) in collectives;
    # one group with a backend per device type serves both.
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init(comm: Any = None, process_sets: list[ProcessSet] | str | None = None, check: bool | None = None) -> None:
    """Join the job. `process_sets`: hvd.ProcessSet objects to register, in order, on every rank
    ("dynamic" or None: none now; add them later with hvd.add_process_set). `check` turns the disagreement check on or off
    (default: on, unless TRIAX_HOROVOD_CHECK=0)."""
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise HorovodTypeError("hvd.init(comm=...) takes an MPI communicator in Horovod; triax has no MPI "
                               "layer: call hvd.init() and start the processes with mpirun or torchrun")
    if comm:
        raise HorovodValueError(f"hvd.init(comm={comm!r}): sub-communicators are not supported; call hvd.init()")
    if basics.is_initialized():
        return  # Horovod allows repeated init(); the second call changes nothing
    timeout_s = gloo_timeout()  # a bad HOROVOD_GLOO_TIMEOUT_SECONDS is one line now, whatever the world size
    place, slot = detect_place(), None
    if elastic_worker.under_driver():
        # triax horovodrun's elastic driver says where this worker is (after a reset: blocks
        # until the driver has decided the next round, or raises WorkerRemoved).
        slot = elastic_worker.join()
        place = Place(slot.rank, slot.size, slot.local_rank, slot.local_size, "horovod")
    # The device Horovod scripts pin themselves (torch.cuda.set_device(hvd.local_rank())) is the
    # one we pick too, so NCCL binds to the same GPU.
    device = pick_device("cuda" if torch.cuda.is_available() else "cpu", place.local_rank)
    owns_group = not dist.is_initialized()
    if place.world_size > 1 or dist.is_initialized():
        store = None
        if owns_group and place.world_size > 1:
            store = elastic_worker.group_store() if slot is not None else _next_store(place)
        place = init_distributed(device, place, backend=_backend_for(device), store=store, timeout_s=timeout_s)
    rank, size = place.rank, place.world_size
    local_rank, local_size = place.local_rank, place.local_world_size
    cross_rank, cross_size, homogeneous = 0, 1, True
    if size > 1:
        # Horovod's cross communicator joins the ranks with the same local rank, one per node.
        mine = [socket.gethostname(), local_rank, local_size]
        everyone: list = [None] * size
        with handles.failures_as_internal_error():
            dist.all_gather_object(everyone, mine)
        same_local = [r for r, entry in enumerate(everyone) if entry[1] == local_rank]
        cross_rank, cross_size = same_local.index(rank), len(same_local)
        homogeneous = len({entry[2] for entry in everyone}) == 1
    if slot is not None:  # the driver's placement names hosts as the user listed them
        cross_rank, cross_size = slot.cross_rank, slot.cross_size
    basics.set_world(basics._World(rank, size, local_rank, local_size, cross_rank, cross_size, homogeneous, device,
                                   _check_from_env() if check is None else bool(check), owns_group))
    # Scripts written for horovodrun read these (`triax horovodrun` sets them before the script
    # starts; other launchers do not).
    os.environ.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(size),
                      HOROVOD_LOCAL_RANK=str(local_rank), HOROVOD_LOCAL_SIZE=str(local_size),
                      HOROVOD_CROSS_RANK=str(cross_rank), HOROVOD_CROSS_SIZE=str(cross_size))
    set_registration.register_at_init(process_sets)
    global _shutdown_registered
    if not _shutdown_registered:
        # As Horovod's init does: leave the job when the script ends. A process group still alive
        # while the interpreter finalizes is destroyed then, and a gloo thread still releasing a
        # collective's tensors needs a GIL that is gone: the process can abort ("terminate called
        # without an active exception") after a run that succeeded. Horovod's own scripts end
        # without hvd.shutdown().
        atexit.register(shutdown)
        _shutdown_registered = True


def gloo_timeout() -> float:
    """Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS bounds every collective; unset: $TRIAX_COLLECTIVE_TIMEOUT
    if set, else Horovod's default, 30 s (triax.runtime.timeouts, their one home)."""
    text = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "").strip()
    if not text:
        if os.environ.get(ENV_COLLECTIVE_TIMEOUT, "").strip():
            return collective_timeout()
        return HOROVOD_GLOO_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = text
    return collective_timeout(value, source="HOROVOD_GLOO_TIMEOUT_SECONDS")


def _next_store(place: Place):
    global _base_store, _generation
    if _base_store is None:
        how = set_rendezvous_defaults(place.launcher)
        with port_taken_explained(how):
            _base_store, _, _ = next(dist.rendezvous("env://", place.rank, place.world_size))
    _generation += 1
    # A fresh prefix per init() (generation) and per torchrun restart attempt (triax.runtime.rendezvous.attempt_store).
    return attempt_store(_base_store, f"triax-horovod/{_generation}")


def shutdown() -> None:
    """Leave the job; `init()` may be called again afterwards."""
    if not basics.is_initialized():
        return
    owns_group = basics.world().owns_group
    handles.forget_all()
    optimizer.forget_in_flight()
    process_sets.forget_all()
    if owns_group:
        shutdown_distributed()
    basics.set_world(None)
