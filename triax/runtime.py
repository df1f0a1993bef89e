"""Who am I, on which device, talking to whom.

Every door (trainer, Accelerator, horovod, pipe) asks this module for its place in the job, so a
process started by torchrun, `triax launch`, Slurm's srun, OpenMPI/MPICH's mpirun, Horovod's own
launcher or as a plain `python script.py` finds its rank the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from triax.errors import TriaxError

# Environment variables of each launcher, in the order they are trusted. torchrun comes first:
# `triax launch` is torchrun, and a torchrun started inside an Slurm allocation must win over Slurm's.
_LAUNCHERS = [
    # name, rank, world size, local rank, local world size
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
]


@dataclass(frozen=True)
class Place:
    """This process's position in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "single"  # which launcher's variables we read

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // max(self.local_world_size, 1)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(name: str, env) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    # Slurm writes SLURM_NTASKS_PER_NODE as e.g. "4(x2)"; the count before the bracket is ours.
    value = value.split("(")[0].split(",")[0]
    try:
        return int(value)
    except ValueError:
        raise TriaxError(f"environment variable {name}={env.get(name)!r} is not an integer") from None


def detect_place(env=None) -> Place:
    """Read rank and world size from whichever launcher started us; a plain process is rank 0 of 1."""
    env = os.environ if env is None else env
    for launcher, rank_var, world_var, local_var, local_world_var in _LAUNCHERS:
        rank, world = _int_env(rank_var, env), _int_env(world_var, env)
        if rank is None or world is None:
            continue
        if launcher == "slurm" and "SLURM_STEP_ID" not in env:
            continue  # inside an allocation but not started by srun: we are one plain process
        local = _int_env(local_var, env)
        local_world = _int_env(local_world_var, env)
        if local is None:
            local = rank
        if local_world is None:
            local_world = world
        if not 0 <= rank < world:
            raise TriaxError(f"{rank_var}={rank} is outside 0..{world - 1} ({world_var}={world})")
        return Place(rank, world, local, local_world, launcher)
    return Place()


def pick_device(requested: str | None = None, local_rank: int = 0) -> torch.device:
    """`requested` ('cpu', 'cuda', 'cuda:1', 'auto' or None) -> the device this process uses.

    With several GPUs on a node, process `local_rank` takes GPU `local_rank`.
    """
    if requested in (None, "", "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TriaxError(f"device {requested!r} was asked for but CUDA is not available here; "
                             "use device=cpu (or install a CUDA build of torch)")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


DEFAULT_PROCESS_GROUP_TIMEOUT_S = 600.0


def process_group_timeout() -> float:
    """$TRIAX_COLLECTIVE_TIMEOUT (`triax launch --collective-timeout`) if set, else 600 s."""
    from triax.watchdog import ENV_COLLECTIVE_TIMEOUT, collective_timeout

    return collective_timeout() if os.environ.get(ENV_COLLECTIVE_TIMEOUT, "").strip() else DEFAULT_PROCESS_GROUP_TIMEOUT_S


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
    set_rendezvous_defaults()
    backend = backend or default_backend(device)
    timeout = datetime.timedelta(seconds=process_group_timeout() if timeout_s is None else timeout_s)
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


# ---- rendezvous: one home for the rules every door follows ------------------------------------

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


def restart_count(env=None) -> int:
    """How many times torchrun's agent has restarted this job's workers (--max-restarts); 0 for a
    first attempt or a process torchrun did not start."""
    env = os.environ if env is None else env
    return _int_env("TORCHELASTIC_RESTART_COUNT", env) or 0


def set_rendezvous_defaults() -> None:
    """mpirun, Slurm and a plain process set no rendezvous address: the job then meets on this
    machine, at torch's usual port, unless MASTER_ADDR/MASTER_PORT say otherwise."""
    os.environ.setdefault("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))


def attempt_store(store, scope: str):
    """`store` seen through a key prefix of its own for this restart attempt. torchrun's agent keeps
    its store across worker restarts, so keys a failed attempt left there (gloo's addresses of dead
    ranks, a half-finished barrier) would otherwise be read by the restarted workers."""
    return dist.PrefixStore(f"{scope}/attempt_{restart_count()}", store)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (for a rendezvous on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    # NCCL only reduces CUDA tensors; gloo takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- collectives that end cleanly at exit ------------------------------------------------------

# The latest collectives triax started, kept until the process ends (see keep_until_exit).
_kept_works: list = []
EXIT_WAIT_SECONDS = 30


def keep_until_exit(works) -> None:
    """Hold on to these torch.distributed works (async collectives) so the interpreter never
    finalizes while gloo's worker thread still needs the GIL for them.

    A gloo work started from Python carries Python state, and whichever thread drops the last
    reference to it needs the GIL to release that state; so does a `future.then` callback once it
    has run. If that thread is gloo's and the main thread has meanwhile run off the end of the
    script, CPython is finalizing and ends the thread with pthread_exit, whose unwinding through
    C++ aborts the process after a run that succeeded ("terminate called without an active
    exception", exit -6). So the works are kept here; `_finish_works_before_exit` waits for them
    (a work is marked finished only after its callbacks are released) and never lets them go.
    Works already finished are dropped on the next call, long after gloo is done with them."""
    _kept_works[:] = [work for work in _kept_works if not work.is_completed()]
    _kept_works.extend(works)


def finish(work) -> None:
    """Wait for one collective started with async_op=True, keeping it until exit."""
    work.wait()
    keep_until_exit([work])


@atexit.register
def _finish_works_before_exit() -> None:
    for work in _kept_works:
        try:
            # Work.wait releases the GIL, which gloo's worker thread needs to finish the work.
            work.wait(datetime.timedelta(seconds=EXIT_WAIT_SECONDS))
        except Exception:  # a failed or timed-out collective was already reported where it ran
            pass
    # A reference the interpreter never drops: no kept work is destroyed during finalization.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept_works))


_decision_buffers: dict = {}


def _decision_buffer(value: int) -> torch.Tensor:
    # One long-lived tensor per device, reused. A fresh tensor per call can have its last reference
    # dropped by gloo's worker thread, which then needs the GIL; if that happens while the main
    # thread tears the process group down (holding the GIL), the process hangs at exit.
    device = collective_device()
    buffer = _decision_buffers.get(device)
    if buffer is None:
        buffer = _decision_buffers[device] = torch.zeros(1, dtype=torch.int64, device=device)
    buffer.fill_(int(value))
    return buffer


def max_across_ranks(value: int) -> int:
    """The largest of every rank's `value` (a collective: all ranks call it). Used to agree on a
    decision, e.g. "stop now" or "the snapshot write failed somewhere"."""
    if not is_distributed():
        return int(value)
    tensor = _decision_buffer(value)
    finish(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True))
    return int(tensor.item())


def mean_across_ranks(value: float) -> float:
    """The mean of every rank's `value` (a collective), e.g. a loss for logging."""
    if not is_distributed():
        return float(value)
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
    finish(dist.all_reduce(tensor, async_op=True))
    return tensor.item() / dist.get_world_size()


def any_rank(flag: bool) -> bool:
    return max_across_ranks(int(bool(flag))) > 0


def all_ranks(flag: bool) -> bool:
    return not any_rank(not flag)


class RankFailedError(TriaxError, RuntimeError):
    """Another rank failed in a step every rank had to finish; that rank reports its own error."""


@contextlib.contextmanager
def raise_together(doing: str):
    """Run a block that may fail on some ranks only (rank 0 writing a file, one rank reading its
    own RNG file), then agree on the outcome (a collective: every rank must enter it): if the block
    failed anywhere, every rank raises, the failing ranks their own error and the others
    RankFailedError naming the first failing rank and its error. Without this a rank that raises
    alone leaves the others waiting in their next collective until the process-group timeout."""
    failure = None
    try:
        yield
    except Exception as error:  # agreed on below, then raised again unchanged
        failure = error
    agreed = first_failure(failure)
    if failure is not None:
        raise failure
    if agreed is not None:
        rank, message = agreed
        raise RankFailedError(f"rank {rank} failed while {doing} ({message}); every rank stops")


def first_failure(error: BaseException | None) -> tuple[int, str] | None:
    """A collective (every rank calls it): None when `error` is None on every rank, else the lowest
    failing rank and the first line of its error ("OSError: ..."), the same on every rank. The one
    agreement behind `raise_together` here and the Accelerator's."""
    if not any_rank(error is not None):
        return None
    message = "" if error is None else f"{type(error).__name__}: {error}".splitlines()[0][:500]
    if not is_distributed():
        return 0, message
    messages = all_gather_bytes(message.encode())
    return next((rank, text.decode(errors="replace")) for rank, text in enumerate(messages) if text)


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every rank's bytes, in rank order (lengths first, then padded to the longest), without
    pickling: a collective."""
    device = collective_device()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    finish(dist.all_gather(lengths, length, async_op=True))
    mine = torch.zeros(max(int(n) for n in lengths), dtype=torch.uint8, device=device)
    mine[:len(payload)] = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    everyone = [torch.zeros_like(mine) for _ in lengths]
    finish(dist.all_gather(everyone, mine, async_op=True))
    return [bytes(item[:int(n)].cpu().tolist()) for item, n in zip(everyone, lengths)]


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank `src`'s `value` on every rank (a collective)."""
    if not is_distributed():
        return int(value)
    tensor = _decision_buffer(value)
    finish(dist.broadcast(tensor, src=src, async_op=True))
    return int(tensor.item())


def barrier() -> None:
    if is_distributed():
        finish(dist.barrier(async_op=True))


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), indexed by rank (a collective)."""
    if not is_distributed():
        return [list(map(float, values))]
    local = torch.tensor(values, dtype=torch.float64, device=collective_device())
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    finish(dist.all_gather(gathered, local, async_op=True))
    return [tensor.tolist() for tensor in gathered]


# ---- host memory: give freed tensor buffers back to the operating system ----------------------

# Buffers of at least this many bytes get pages of their own (mmap) and go back to the OS on free.
HOST_MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
# The user's own settings of the same knobs, which we leave alone.
_ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_ALLOCATOR_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad",
                       "glibc.malloc.mmap_max")
_host_allocator_tuned: bool | None = None


def return_freed_memory_to_os(env=None) -> bool:
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
    if not sys.platform.startswith("linux") or not _glibc_version():
        return False  # musl, macOS, Windows: their allocators behave otherwise; leave them be
    try:
        libc = ctypes.CDLL("libc.so.6")
        _host_allocator_tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD))
    except (OSError, AttributeError):  # a glibc without the usual soname or symbol: leave it as it is
        pass
    return _host_allocator_tuned


def _glibc_version() -> str:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; unknown name off glibc
    except (ValueError, OSError):
        return ""
