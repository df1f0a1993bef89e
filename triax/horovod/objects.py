"""Picklable Python objects across ranks: `broadcast_object` and `allgather_object`."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from triax.horovod import basics, check, engine, handles, process_sets
from triax.horovod.process_sets import ProcessSet, global_process_set, in_process_set


@in_process_set
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set):
    """Every rank returns root_rank's `obj` (pickled on the way)."""
    problem = engine.root_problem("broadcast_object", root_rank, name)
    check.agree("broadcast_object", root=root_rank if problem is None else -1, name=name, problem=problem)
    if process_sets.active_size() == 1:
        return obj
    holder = [obj if basics.rank() == root_rank else None]
    with handles.failures_as_internal_error():
        dist.broadcast_object_list(holder, src=root_rank, group=process_sets.active_group())
    return holder[0]


@in_process_set
def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set):
    """A list with every rank's `obj`, in rank order."""
    if process_sets.active_size() == 1:
        return [obj]
    check.agree("allgather_object", name=name)
    everyone = [None] * process_sets.active_size()
    with handles.failures_as_internal_error():
        dist.all_gather_object(everyone, obj, group=process_sets.active_group())
    return everyone
