"""`hvd.add_process_set` and `hvd.remove_process_set`: collectives of every rank.

torch.distributed requires every rank to create (and destroy) every group in the same order, so
each rank first shares what it is about to add or remove in a check round (check.py); a rank
whose request is wrong makes every rank raise, before any group is made. The sets themselves are
kept by process_sets.py, below the check round.
"""

from __future__ import annotations

import torch.distributed as dist

from triax.horovod import basics, check, process_sets
from triax.horovod.process_sets import ProcessSet, global_process_set
from triax.horovod.errors import HorovodTypeError
from triax.runtime.process_group import shutdown_distributed


def _register(process_set: ProcessSet) -> ProcessSet:
    world = basics.world()
    bad = [r for r in process_set.ranks if r >= world.size]
    problem = f"hvd.add_process_set: ranks {bad} do not exist (size {world.size})" if bad else None
    if problem is None and process_set.ranks in process_sets.registered_ranks():
        problem = f"hvd.add_process_set: a process set with ranks {process_set.ranks} already exists"
    if problem is None and process_set.process_set_id is not None:
        problem = f"hvd.add_process_set: {process_set!r} is already registered"
    # Every rank must ask for the same set, in the same order, before the group is made.
    check.agree("process set", extra=",".join(map(str, process_set.ranks)), name="add_process_set",
                problem=problem)
    group = dist.new_group(process_set.ranks) if world.size > 1 else None
    return process_sets.record(process_set, group)


def add_process_set(process_set: ProcessSet) -> ProcessSet:
    """Register a set (a ProcessSet or a list of ranks) on every rank; call it on all ranks."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return _register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget a set added before (every rank calls it); False for the global or an unknown set."""
    if process_set is global_process_set or not process_sets.is_registered(process_set):
        return False
    check.agree("process set", extra="remove " + ",".join(map(str, process_set.ranks)),
                name="remove_process_set")
    group = process_sets.drop(process_set)
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        shutdown_distributed(group)
    return True


def register_at_init(sets: list[ProcessSet] | str | None) -> None:
    """`hvd.init(process_sets=[...])`: register each, in order, right after joining the job."""
    if sets in (None, "dynamic"):
        return
    if not isinstance(sets, (list, tuple)):
        raise HorovodTypeError(f"hvd.init(process_sets=...) takes a list of hvd.ProcessSet, got {sets!r}")
    for process_set in sets:
        add_process_set(process_set)
