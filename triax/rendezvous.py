"""The rendezvous rules every door follows: where the job meets, and clean keys per restart."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from triax.place import int_from_env

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


def restart_count(env=None) -> int:
    """How many times torchrun's agent has restarted this job's workers (--max-restarts); 0 for a
    first attempt or a process torchrun did not start."""
    env = os.environ if env is None else env
    return int_from_env("TORCHELASTIC_RESTART_COUNT", env) or 0


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


def loopback_store(port: int, timeout_s: float, multi_tenant: bool = False):
    """A TCPStore server listening on 127.0.0.1 only, at `port` (0: a free one).

    A TCPStore is unauthenticated, and its server listens on every interface whatever host it is
    given; one made on a socket already bound to loopback (`master_listen_fd`) listens there only.
    The store owns that socket from then on (it closes it when it goes)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    descriptor = listener.detach()
    try:
        return dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=descriptor)
    except BaseException:
        os.close(descriptor)
        raise
