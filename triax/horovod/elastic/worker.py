"""A worker of `triax horovodrun`'s elastic driver: where it learns its rank, and host changes.

The driver starts each worker with its slot in Horovod's variables (HOROVOD_RANK, ...) and the
round it starts in. The first `hvd.init()` takes those; every later one (after `hvd.shutdown()`,
which `hvd.elastic.run` does on a reset) tells the driver this worker is ready for the next round
and waits for the slot the driver gives it, as Horovod's workers ask its rendezvous server again.
See protocol.py for the exchange.
"""

from __future__ import annotations

import datetime
import os
from typing import Mapping

import torch.distributed as dist

from triax.horovod.elastic import protocol
from triax.horovod.errors import WorkerRemoved
from triax.horovod.slots import SlotInfo


class _Worker:
    """What this process knows of the driver: one per process, made on first use."""

    def __init__(self, env: Mapping[str, str]):
        self.name = env[protocol.WORKER_ENV]
        self.hostname = env.get("HOROVOD_HOSTNAME", "localhost")
        self.timeout_s = float(env.get(protocol.TIMEOUT_ENV) or protocol.DEFAULT_ELASTIC_TIMEOUT_S)
        self.round = int(env[protocol.ROUND_ENV])
        self.notices_seen = int(env.get(protocol.NOTICES_ENV) or 0)
        self.slot = SlotInfo(self.hostname, int(env["HOROVOD_RANK"]), int(env["HOROVOD_LOCAL_RANK"]),
                             int(env["HOROVOD_CROSS_RANK"]), int(env["HOROVOD_SIZE"]),
                             int(env["HOROVOD_LOCAL_SIZE"]), int(env["HOROVOD_CROSS_SIZE"]))
        self.joined = False
        self.store = dist.TCPStore(env[protocol.ADDRESS_ENV], int(env[protocol.PORT_ENV]), is_master=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))


_worker: _Worker | None = None


def under_driver(env: Mapping[str, str] | None = None) -> bool:
    """True in a process started by `triax horovodrun`'s elastic driver."""
    env = os.environ if env is None else env
    return env.get(protocol.ELASTIC_ENV) == "1" and protocol.WORKER_ENV in env and protocol.ADDRESS_ENV in env


def _get() -> _Worker:
    global _worker
    if _worker is None:
        _worker = _Worker(os.environ)
    return _worker


def join() -> SlotInfo:
    """This worker's slot in the current round: the one it was started with on the first call;
    afterwards, the one the driver gives it for the next round (WorkerRemoved if none)."""
    worker = _get()
    if worker.joined:
        worker.store.set(protocol.ready_key(worker.round, worker.name), "1")
        key = protocol.assignment_key(worker.round + 1, worker.name)
        worker.store.wait([key], datetime.timedelta(seconds=worker.timeout_s))
        answer = worker.store.get(key).decode()
        worker.round += 1
        if answer == protocol.REMOVED_ANSWER:
            raise WorkerRemoved(f"{worker.hostname}[{worker.slot.local_rank}] has been removed from the elastic job")
        slot, _, seen = answer.partition(";")
        worker.slot = SlotInfo.decode(worker.hostname, slot)
        worker.notices_seen = int(seen)
    worker.joined = True
    return worker.slot


def group_store():
    """The store this round's process group meets on: a key prefix of the round's own."""
    worker = _get()
    return dist.PrefixStore(protocol.group_prefix(worker.round), worker.store)


def host_updates() -> int:
    """Horovod's HostUpdateResult flags of the notices the driver sent since the last call (rank 0
    asks; state.check_host_updates shares the answer with the other ranks)."""
    worker = _get()
    count = worker.store.add(protocol.NOTICE_COUNT_KEY, 0)
    flags = protocol.NO_UPDATE
    for number in range(worker.notices_seen + 1, count + 1):
        flags |= int(worker.store.get(protocol.notice_key(number)))
    worker.notices_seen = count
    return flags
