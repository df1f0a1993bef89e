"""The small collectives triax's own code runs: decisions every rank must share ("stop now",
"which snapshot"), a loss mean for logging, per-rank timings, bytes without pickling.

The decisions are no-ops on a single process; every work is kept until exit (kept_works.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from triax.runtime.collectives_at_exit import wait_and_keep
from triax.runtime.process_group import collective_device, is_distributed

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
    wait_and_keep(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True))
    return int(tensor.item())


def mean_across_ranks(value: float) -> float:
    """The mean of every rank's `value` (a collective), e.g. a loss for logging."""
    if not is_distributed():
        return float(value)
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
    wait_and_keep(dist.all_reduce(tensor, async_op=True))
    return tensor.item() / dist.get_world_size()


def any_rank(flag: bool) -> bool:
    return max_across_ranks(int(bool(flag))) > 0


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every rank's bytes, in rank order (lengths first, then padded to the longest), without
    pickling: a collective."""
    device = collective_device()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    wait_and_keep(dist.all_gather(lengths, length, async_op=True))
    mine = torch.zeros(max(int(n) for n in lengths), dtype=torch.uint8, device=device)
    mine[:len(payload)] = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    everyone = [torch.zeros_like(mine) for _ in lengths]
    wait_and_keep(dist.all_gather(everyone, mine, async_op=True))
    return [bytes(item[:int(n)].cpu().tolist()) for item, n in zip(everyone, lengths)]


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank `src`'s `value` on every rank (a collective)."""
    if not is_distributed():
        return int(value)
    tensor = _decision_buffer(value)
    wait_and_keep(dist.broadcast(tensor, src=src, async_op=True))
    return int(tensor.item())


def barrier() -> None:
    if is_distributed():
        wait_and_keep(dist.barrier(async_op=True))

def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), indexed by rank (a collective)."""
    if not is_distributed():
        return [list(map(float, values))]
    local = torch.tensor(values, dtype=torch.float64, device=collective_device())
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    wait_and_keep(dist.all_gather(gathered, local, async_op=True))
    return [tensor.tolist() for tensor in gathered]
