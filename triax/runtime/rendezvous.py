"""The rendezvous rules every door follows: where the job meets, and clean keys per restart."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import Mapping

import torch.distributed as dist

from triax.runtime import slurm
from triax.errors import TriaxError
from triax.runtime.place import int_from_env

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun's agent has restarted this job's workers (--max-restarts); 0 for a
    first attempt or a process torchrun did not start."""
    env = os.environ if env is None else env
    return int_from_env("TORCHELASTIC_RESTART_COUNT", env) or 0


class RendezvousError(TriaxError, RuntimeError):
    """The job cannot meet where it was told to (torch raises a RuntimeError there)."""


def set_rendezvous_defaults(launcher: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """Fill MASTER_ADDR/MASTER_PORT where the launcher set none, and say where they came from.

    srun's tasks (`launcher == "slurm"`) meet on the step's first node at a port derived from the
    job id, alike on every task (triax.runtime.slurm); mpirun and a plain process meet on this machine at
    torch's usual port. MASTER_ADDR/MASTER_PORT, when set, always win."""
    env = os.environ if env is None else env
    how = "MASTER_ADDR/MASTER_PORT"
    if launcher == "slurm" and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        host, port, how = slurm.rendezvous_address(env)
        env.setdefault("MASTER_ADDR", host)
        env.setdefault("MASTER_PORT", str(port))
    env.setdefault("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    env.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    return how


@contextlib.contextmanager
def port_taken_explained(how: str, env: Mapping[str, str] | None = None):
    """Around the first rendezvous: rank 0 could not listen on the port -> one line saying which
    port, where it came from and what to do (torch's own error is a paragraph)."""
    env = os.environ if env is None else env
    try:
        yield
    except dist.DistNetworkError as error:
        if "EADDRINUSE" not in str(error) and "address already in use" not in str(error).lower():
            raise
        raise RendezvousError(f"the rendezvous port {env.get('MASTER_PORT')} on {env.get('MASTER_ADDR')} is "
                              f"already in use (another job or process listens there; the address came from "
                              f"{how}); set MASTER_PORT to a free port") from None


def attempt_store(store: dist.Store, scope: str):
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
