"""Fusion buckets: which gradients travel together in one allreduce.

Horovod fuses whatever tensors are ready within a cycle, up to HOROVOD_FUSION_THRESHOLD bytes,
after negotiating among ranks. Without a coordinator the buckets are fixed up front instead,
identically on every rank (same parameters, same order), so every rank launches the same
allreduces in the same order, which torch.distributed requires.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from triax.horovod.errors import HorovodValueError

FUSION_ENV = "HOROVOD_FUSION_THRESHOLD"
DEFAULT_FUSION_BYTES = 64 * 1024 * 1024


def fusion_threshold() -> int:
    raw = os.environ.get(FUSION_ENV, "")
    if raw == "":
        return DEFAULT_FUSION_BYTES
    try:
        return int(raw)
    except ValueError:
        raise HorovodValueError(f"{FUSION_ENV}={raw!r} is not a number of bytes; e.g. {FUSION_ENV}=67108864") from None


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    names: list[str]
    numel: int = 0
    ready: int = 0  # parameters whose gradient is final for this step
    flat: torch.Tensor | None = None  # reused between steps
    pending: tuple | None = None  # (works, wire, ctx) while the allreduce is in flight
    offsets: list[int] = field(default_factory=list)

    def describe(self) -> str:
        return ",".join(f"{n}{tuple(p.shape)}{str(p.dtype)[6:]}" for n, p in zip(self.names, self.params))


def _make(params: list[torch.Tensor], names_by_id: dict[int, str]) -> Bucket:
    bucket = Bucket(list(params), [names_by_id[id(p)] for p in params])
    offset = 0
    for p in bucket.params:
        bucket.offsets.append(offset)
        offset += p.numel()
    bucket.numel = offset
    return bucket


def plan_buckets(params: list, names_by_id: dict, threshold: int,
                 groups: list[list[torch.Tensor]] | int | None = None) -> list[Bucket]:
    """Split `params` (in launch order) into buckets.

    groups: None (by size), an int (that many buckets of about equal size), or a list of
    parameter lists (each fused on its own; the rest by size), as in Horovod.
    """
    if isinstance(groups, int) and groups > 0:
        per = -(-len(params) // groups)
        chunks = [params[i:i + per] for i in range(0, len(params), per)]
        return [_make(chunk, names_by_id) for chunk in _split_by_kind(chunks)]
    chunks: list[list] = []
    if groups:
        known = {id(p) for p in params}
        claimed = set()
        for group in groups:
            group = [p for p in group if id(p) in known]
            if any(id(p) in claimed for p in group):
                raise HorovodValueError("DistributedOptimizer(groups=...): a parameter appears in two groups; "
                                 "give each parameter to at most one group")
            claimed |= {id(p) for p in group}
            # keep launch order inside a group
            order = {id(p): i for i, p in enumerate(params)}
            chunks.append(sorted(group, key=lambda p: order[id(p)]))
        params = [p for p in params if id(p) not in claimed]
    current, current_bytes = [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (current_bytes + nbytes > threshold or _kind(p) != _kind(current[0])):
            chunks.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
    if current:
        chunks.append(current)
    return [_make(chunk, names_by_id) for chunk in _split_by_kind(chunks) if chunk]


def _kind(p: torch.Tensor) -> tuple:
    return (p.dtype, p.device)


def _split_by_kind(chunks: list):
    """One flat buffer needs one dtype and device: split any chunk that mixes them."""
    for chunk in chunks:
        part: list = []
        for p in chunk:
            if part and _kind(p) != _kind(part[0]):
                yield part
                part = []
            part.append(p)
        if part:
            yield part
