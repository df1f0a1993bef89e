"""Horovod's process sets: collectives among a subset of ranks, on `torch.distributed.new_group`.

    evens = hvd.ProcessSet([0, 2]); hvd.init(process_sets=[evens])     # or, after init:
    evens = hvd.add_process_set([0, 2])                                 # every rank calls this
    hvd.allreduce(x, process_set=evens)                                 # ranks 0 and 2 only

torch.distributed requires every rank to create every group, in the same order, so adding (and
removing) a set is a collective of all ranks, agreed before the group is made (set_registration.py,
above the check round it uses; this module only keeps the sets). A collective given `process_set=` runs inside `scoped(set)`: the engine then asks
`active_group()`, `active_size()` and `active_rank()` instead of the world's, and the check round
runs among the set's ranks only. `root_rank` stays a global rank, as in Horovod.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Sequence, TYPE_CHECKING

from triax.horovod import basics
from triax.horovod.errors import HorovodTypeError, HorovodValueError

if TYPE_CHECKING:
    import torch.distributed as dist


class ProcessSet:
    """A set of ranks that run collectives among themselves (Horovod's `hvd.ProcessSet`)."""

    def __init__(self, ranks: Sequence[int] | None = None):
        if ranks is None:
            self.ranks = None  # every rank: the global set
        else:
            try:
                ranks = [int(r) for r in ranks]
            except (TypeError, ValueError):
                raise HorovodTypeError(f"hvd.ProcessSet takes a list of ranks, got {ranks!r}") from None
            if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0:
                raise HorovodValueError(f"hvd.ProcessSet ranks {ranks} must be distinct ranks >= 0, at least one")
            self.ranks = sorted(ranks)
        self.process_set_id: int | None = 0 if ranks is None else None
        self._group = None  # the torch.distributed group, once registered

    def _all_ranks(self) -> list[int]:
        return list(range(basics.size())) if self.ranks is None else self.ranks

    def size(self) -> int | None:
        """Number of ranks in the set; None while it is not registered."""
        if self.process_set_id is None or not basics.is_initialized():
            return None
        return len(self._all_ranks())

    def rank(self) -> int | None:
        """This process's rank within the set, -1 if not in it; None while not registered."""
        if self.process_set_id is None or not basics.is_initialized():
            return None
        ranks = self._all_ranks()
        return ranks.index(basics.rank()) if basics.rank() in ranks else -1

    def included(self) -> bool | None:
        if self.process_set_id is None or not basics.is_initialized():
            return None
        return basics.rank() in self._all_ranks()

    def __repr__(self) -> str:
        if self.ranks is None:
            return "ProcessSet(global)"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
_registered: dict[int, ProcessSet] = {0: global_process_set}
_next_id = 1
_active = threading.local()


def record(process_set: ProcessSet, group: dist.ProcessGroup | None) -> ProcessSet:
    """Give an agreed set its id and torch.distributed group (set_registration.py agrees first)."""
    global _next_id
    process_set._group = group
    process_set.process_set_id = _next_id
    _registered[_next_id] = process_set
    _next_id += 1
    return process_set


def is_registered(process_set: ProcessSet) -> bool:
    return _registered.get(process_set.process_set_id) is process_set


def registered_ranks() -> list[list[int]]:
    return [p.ranks for p in _registered.values() if p.ranks]


def drop(process_set: ProcessSet):
    """Forget a registered set; returns its torch.distributed group for the caller to destroy."""
    del _registered[process_set.process_set_id]
    group, process_set._group, process_set.process_set_id = process_set._group, None, None
    return group


def forget_all() -> None:
    """shutdown(): groups die with the default group; sets must be added again after init()."""
    global _next_id
    for process_set in list(_registered.values()):
        if process_set is not global_process_set:
            process_set._group, process_set.process_set_id = None, None
    _registered.clear()
    _registered[0] = global_process_set
    _next_id = 1


# ---- the set the current collective runs on ---------------------------------------------------
def _resolve(process_set: ProcessSet | int) -> ProcessSet:
    if process_set is None or process_set is global_process_set:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise HorovodTypeError(f"process_set={process_set!r} is not an hvd.ProcessSet")
    if _registered.get(process_set.process_set_id) is not process_set:
        raise HorovodValueError(f"{process_set!r} is not registered; pass it to hvd.init(process_sets=[...]) "
                                "or hvd.add_process_set(...) on every rank first")
    if not process_set.included():
        raise HorovodValueError(f"this rank ({basics.rank()}) is not in {process_set!r}; only its ranks may "
                                "run collectives on it")
    return process_set


@contextlib.contextmanager
def scoped(process_set: ProcessSet | int):
    """Run the enclosed collectives on `process_set` (validated: registered, this rank in it)."""
    basics.world()
    process_set = _resolve(process_set)
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    stack.append(process_set)
    try:
        yield process_set
    finally:
        stack.pop()


def current() -> ProcessSet:
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else global_process_set


def active_group():
    """The torch.distributed group of the current set (None: the default group)."""
    return current()._group


def active_size() -> int:
    process_set = current()
    return basics.size() if process_set.ranks is None else len(process_set.ranks)


def active_rank() -> int:
    process_set = current()
    return basics.rank() if process_set.ranks is None else process_set.ranks.index(basics.rank())


def active_ranks() -> list[int]:
    return current()._all_ranks()


def in_process_set(function: Callable):
    """Decorate a public collective: its body runs on the `process_set=` argument's set."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any):
        chosen = signature.bind_partial(*args, **kwargs).arguments.get("process_set", global_process_set)
        with scoped(chosen):
            return function(*args, **kwargs)

    return wrapper
