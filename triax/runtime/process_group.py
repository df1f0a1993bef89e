"""Joining and leaving the job's default process group."""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

if dist.is_available():
    # torch.distributed.nn.functional's collectives default to `group=group.WORLD`, a value taken
    # when the module is first imported. torch.optim imports it (through torch._dynamo and FSDP) when
    # an optimizer is first built: after the default group exists, its ten functions would hold that
    # group for the life of the process, and destroy_process_group() could not free it: gloo's
    # threads and connections would stay, and the peers of a rank that left an elastic job would wait
    # for it until their collective timed out. Imported here, before any group, the default is None.
    import torch.distributed.nn.functional  # noqa: F401

from triax.runtime import collectives_at_exit as kept_works
from triax.runtime.place import Place, default_backend, detect_place
from triax.runtime.rendezvous import attempt_store, port_taken_explained, set_rendezvous_defaults
from triax.runtime.timeouts import process_group_timeout


def init_distributed(device: torch.device, place: Place | None = None, backend: str | None = None,
                     timeout_s: float | None = None, store: dist.Store | None = None) -> Place:
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
    global _created_here
    _created_here = True
    # Moved to the end of the exit handlers: it runs before those registered until now (the
    # script's own, made before the group existed, see the group gone), still before kept_works'.
    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)
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


# After a gloo collective completes, gloo's worker thread still has to release the work, and a work
# started during backward (or with a Python comm hook) holds Python state, so that release needs
# the GIL. Two ways this goes wrong at the end of a job:
# - the group's last reference goes away while the main thread holds the GIL (destroying the
#   group joins gloo's threads): if a thread still needs the GIL, both wait forever (Accelerate's
#   own test_sync hung at exit in 2 runs of 15);
# - the interpreter finalizes first: CPython ends a thread that asks for the GIL then with
#   pthread_exit, whose unwinding through gloo's C++ destructor calls std::terminate, and a run
#   that succeeded aborts ("terminate called without an active exception", exit -6). On a loaded
#   machine gloo's thread can wait tens of milliseconds for a CPU after marking the work done,
#   while the main thread runs off the end of the script.
# So before a group is destroyed, and before the interpreter finalizes, the main thread lets go of
# the GIL until every other thread of the process is asleep (none runnable): gloo's threads have
# then finished releasing and wait for work that will not come. Bounded: a thread of the user's
# that keeps computing does not hold the exit up for more than SETTLE_LIMIT_SECONDS.
SETTLE_LIMIT_SECONDS = 2.0
SETTLE_POLL_SECONDS = 0.005
SETTLE_QUIET_POLLS = 2  # asleep at two looks in a row, not caught between two runs
GLOO_RELEASE_SECONDS = 0.05  # where threads cannot be seen (no /proc): a fixed hand-over

_created_here = False  # the default group was made by init_distributed: it is ours to tear down
GLOO_THREAD_NAMES = (b"pt_gloo", b"gloo")  # what gloo names its threads (pt_gloo_runloop, gloo_tcp_loop)


def _other_threads() -> list[tuple[bytes, bytes]] | None:
    """(name, state) of every thread of this process but the caller (Linux's /proc/self/task;
    state R: running or runnable); None where that cannot be read."""
    me = str(threading.get_native_id())
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    threads = []
    for task in tasks:
        if task == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as handle:
                stat = handle.read(4096)
        except OSError:
            continue  # the thread ended
        # "pid (comm) S ...": comm may hold spaces and parentheses, so split at the last ")".
        head, _, tail = stat.rpartition(b")")
        threads.append((head.partition(b"(")[2], tail[1:2]))
    return threads


def settle_threads(limit_s: float = SETTLE_LIMIT_SECONDS) -> None:
    """Release the GIL until no other thread of this process is runnable (see above)."""
    threads = _other_threads()
    if threads is not None and not any(name.startswith(GLOO_THREAD_NAMES) for name, _ in threads):
        return  # no gloo thread to wait for: a process that never used gloo pays nothing at exit
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < SETTLE_QUIET_POLLS and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_SECONDS)
        threads = _other_threads()
        if threads is None:
            time.sleep(GLOO_RELEASE_SECONDS)
            return
        quiet = 0 if any(state == b"R" for _, state in threads) else quiet + 1


def shutdown_distributed(group: dist.ProcessGroup | None = None) -> None:
    """Destroy `group` (default: every group) so that none of gloo's threads or connections
    outlives it: wait for the kept collectives, let gloo's threads finish (above), destroy, then
    drop the kept collectives, which would otherwise hold gloo's sockets open (kept_works.py).

    gloo's group cannot be aborted: in torch 2.13 its abort() and shutdown() are Backend's no-ops
    (they neither close its connections nor end a collective in flight). It is freed, threads and
    connections, only when its last reference goes, so nothing may keep one (see the import of
    torch.distributed.nn.functional above)."""
    global _created_here
    if group is None:
        kept_works.finish_all()
    if dist.is_initialized():
        if "gloo" in str(dist.get_backend(group)):
            settle_threads()
        dist.destroy_process_group(group)
    if group is None:
        kept_works.release_all()
        _created_here = False


def _shutdown_at_exit() -> None:
    """Every door's teardown at the end of the script (normal end, exception, Ctrl-C): the group
    init_distributed made is destroyed before the interpreter finalizes (see above). A group the
    script made is the script's, whether it is still alive or already destroyed (a DDP model or a
    comm hook's state may still hold it, and PowerSGD's callbacks run on gloo's thread): its
    threads are only let finish."""
    if _created_here:
        shutdown_distributed()
    else:
        settle_threads()


# Registered when triax's distributed part is first imported, whoever makes the group later, and
# after kept_works' own handler (imported above), so it runs first.
atexit.register(_shutdown_at_exit)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    # NCCL only reduces CUDA tensors; gloo takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
