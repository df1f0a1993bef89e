"""Joining and leaving the job's default process group."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from triax.place import Place, default_backend, detect_place
from triax.rendezvous import attempt_store, port_taken_explained, set_rendezvous_defaults
from triax.timeouts import process_group_timeout


def init_distributed(device: torch.device, place: Place | None = None, backend: str | None = None,
                     timeout_s: float | None = None, store=None) -> Place:
    """Join the default process group if the job has more than one process.

    `timeout_s` bounds every collective (and the start-up rendezvous); default: process_group_timeout().

    Works whether or not someone (torchrun's user script, the Accelerator's caller) already created
    the group: an existing group is used as it is. `store` (a torch.distributed Store) replaces the
    env:// rendezvous, e.g. to rejoin after a shutdown under a fresh key prefix.
    """
    place = place or detect_place()
    if place.world_size == 1 or dist.is_initialized():
        if dist.is_initialized() and dist.get_world_size() != place.world_size:
            # The existing group is the truth; describe ourselves from it.
            return Place(dist.get_rank(), dist.get_world_size(), place.local_rank,
                         place.local_world_size, place.launcher)
        return place
    how = set_rendezvous_defaults(place.launcher)
    backend = backend or default_backend(device)
    timeout = datetime.timedelta(seconds=process_group_timeout() if timeout_s is None else timeout_s)
    with port_taken_explained(how):
        dist.init_process_group(
            backend=backend, rank=place.rank, world_size=place.world_size, timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=store if store is not None else _restart_safe_store(place, timeout),
        )
    return place


def _restart_safe_store(place: Place, timeout: datetime.timedelta):
    """Under torchrun the workers share the agent's key-value store, which outlives a worker
    restart (--max-restarts). The process group's keys from the failed attempt (e.g. gloo's
    addresses of dead ranks) would still be there and the restarted workers would try to
    connect to the dead ones. A prefix per attempt gives each attempt clean keys. Returns None
    (the default env:// store) when not restarted by torchrun's agent."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), place.world_size,
                          is_master=False, timeout=timeout)
    return attempt_store(store, "triax")


# After a gloo collective completes, gloo's worker thread still has to release the work. A work
# started during backward holds Python state (torch keeps backward's contextvars in thread-local
# state, which the work captures), so that release needs the GIL. Destroying the group joins those
# threads, and when the group's last reference goes away inside a C++ destructor (DDP's reducer,
# freed with the model), the main thread joins them while holding the GIL: both wait forever.
# Seen with torch 2.13 on a DDP script that tears down right after its last step (Accelerate's own
# test_sync hung at exit in 2 runs of 15). A short sleep before the teardown hands the GIL over so
# the threads finish releasing first; the DDP collectives have completed by then (the reducer
# waits for them before the optimizer step), so nothing else is waited for.
GLOO_RELEASE_SECONDS = 0.05


def shutdown_distributed(group=None) -> None:
    """Destroy `group` (default: every group), letting gloo's threads finish first (above)."""
    if not dist.is_initialized():
        return
    if "gloo" in str(dist.get_backend(group)):
        time.sleep(GLOO_RELEASE_SECONDS)
    dist.destroy_process_group(group)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    # NCCL only reduces CUDA tensors; gloo takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
