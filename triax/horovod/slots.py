"""Which process runs where: Horovod's assignment of ranks to the slots of a list of hosts.

Hosts are filled in order, each up to its slots, until `max_np` processes are placed: ranks are
host-major, local ranks count from 0 on each host, and a process's cross rank is its host's place
among the hosts that have a process with the same local rank (Horovod's cross communicator).
Both launchers use it: the static one (worker_env, under torchrun) and the elastic driver.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotInfo:
    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def environment(self) -> dict[str, str]:
        """The variables horovodrun gives the process in this slot before its script starts."""
        return {"HOROVOD_HOSTNAME": self.hostname, "HOROVOD_RANK": str(self.rank), "HOROVOD_SIZE": str(self.size),
                "HOROVOD_LOCAL_RANK": str(self.local_rank), "HOROVOD_LOCAL_SIZE": str(self.local_size),
                "HOROVOD_CROSS_RANK": str(self.cross_rank), "HOROVOD_CROSS_SIZE": str(self.cross_size)}

    def encode(self) -> str:
        return ",".join(str(value) for value in (self.rank, self.size, self.local_rank, self.local_size,
                                                 self.cross_rank, self.cross_size))

    @classmethod
    def decode(cls, hostname: str, text: str) -> "SlotInfo":
        rank, size, local_rank, local_size, cross_rank, cross_size = (int(word) for word in text.split(","))
        return cls(hostname, rank, local_rank, cross_rank, size, local_size, cross_size)


def assign(hosts: list[tuple[str, int]], max_np: int | None = None) -> list[SlotInfo]:
    """Every placed process's SlotInfo, in rank order. `hosts`: (name, slots) in assignment order."""
    placed: list[tuple[str, int]] = []  # (host, processes on it)
    total = 0
    for name, slots in hosts:
        take = slots if max_np is None else max(0, min(slots, max_np - total))
        if take:
            placed.append((name, take))
            total += take
    infos, rank = [], 0
    for name, count in placed:
        for local_rank in range(count):
            # the hosts with a process at this local rank, in host order
            peers = [host for host, other in placed if other > local_rank]
            infos.append(SlotInfo(name, rank, local_rank, peers.index(name), total, count, len(peers)))
            rank += 1
    return infos
