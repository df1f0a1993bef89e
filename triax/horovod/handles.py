"""Handles returned by the `_async` collectives, for `hvd.poll` and `hvd.synchronize`.

Horovod hands out integers; each maps to the torch.distributed work still in flight and a
function that turns the finished buffers into the result (unscaling, decompressing, slicing).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from triax.horovod.errors import HorovodValueError


@dataclass
class _Pending:
    works: list  # torch.distributed Work objects; empty when the op already finished
    finish: Callable[[], Any]
    name: str


_pending: dict[int, _Pending] = {}
_counter = itertools.count(1)


def make(works, finish: Callable[[], Any], name: str = "") -> int:
    handle = next(_counter)
    works = [w for w in (works if isinstance(works, (list, tuple)) else [works]) if w is not None]
    _pending[handle] = _Pending(works, finish, name)
    return handle


def _get(handle: int) -> _Pending:
    try:
        return _pending[handle]
    except (KeyError, TypeError):
        raise HorovodValueError(f"handle {handle!r} is unknown or was already synchronized; "
                         "pass the value an hvd.*_async call returned, once") from None


def poll(handle: int) -> bool:
    """True when the operation behind `handle` has finished (synchronize() will not block)."""
    return all(work.is_completed() for work in _get(handle).works)


def synchronize(handle: int):
    """Wait for the operation behind `handle` and return its result."""
    pending = _get(handle)
    del _pending[handle]
    from triax.horovod.engine import wait_all

    wait_all(pending.works)
    return pending.finish()


def forget_all() -> None:
    _pending.clear()
