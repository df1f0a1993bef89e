"""Handles returned by the `_async` collectives, for `hvd.poll` and `hvd.synchronize`, and the
waiting on torch.distributed work that every collective ends with.

Horovod hands out integers and matches operations across ranks by name, so ranks may submit
their asynchronous operations around other calls in different orders. Here the collectives run
in call order (torch.distributed's rule), so an asynchronous operation is started when it is
first needed: at the first `poll`/`synchronize` of any handle (or `hvd.join`), all those not yet
started go, in the order they were submitted. Its result is only observable through a handle, so
this changes no result; it lets a rank submit, fail or wait in another collective first, as in
Horovod. A name may be in flight once: submitting it again before it is synchronized raises
ValueError on the submitting rank only, as Horovod's does.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable

from triax.errors import TriaxError
from triax.runtime.collectives_at_exit import keep_until_exit
from triax.horovod import process_sets
from triax.horovod.errors import HorovodInternalError, HorovodValueError


@contextlib.contextmanager
def failures_as_internal_error():
    """A torch.distributed failure inside (gloo raises a plain RuntimeError when a peer is gone
    or a timeout passes) becomes Horovod's HorovodInternalError, which elastic training loops
    catch. triax's own errors pass through as they are."""
    try:
        yield
    except TriaxError:
        raise
    except RuntimeError as error:
        raise HorovodInternalError(f"a collective failed: {error}") from error


def wait_all(works: list) -> None:
    """Wait for torch.distributed work (failures: HorovodInternalError, above)."""
    with failures_as_internal_error():
        for work in works:
            work.wait()
    keep_until_exit(works)  # so a script that ends right after its last collective exits cleanly


def wait_one(work: Any) -> None:
    """Wait for one collective started with async_op=True (see wait_all)."""
    wait_all([work])


@dataclass
class _Pending:
    start: Callable[[], tuple] | None  # starts the operation: (works, finish); None once started
    process_set: Any  # the set it was submitted on, current again when it starts
    name: str | None  # the caller's name, reserved while in flight
    works: list
    finish: Callable[[], Any] | None


_pending: dict[int, _Pending] = {}
_counter = itertools.count(1)


def submit(start: Callable[[], tuple], name: str | None = None) -> int:
    """A handle for the operation `start()` begins (returning (works, finish)); started later, see above."""
    if name and any(p.name == name for p in _pending.values()):
        raise HorovodValueError(f"an operation named {name!r} is already in flight; synchronize it first "
                                "or give each concurrent operation its own name")
    handle = next(_counter)
    _pending[handle] = _Pending(start, process_sets.current(), name, [], None)
    return handle


def start_submitted() -> None:
    """Start every submitted operation not started yet, in submission order (the same on every rank)."""
    for handle in sorted(_pending):
        pending = _pending[handle]
        if pending.start is None:
            continue
        start, pending.start = pending.start, None
        try:
            with process_sets.scoped(pending.process_set):
                works, pending.finish = start()
        except BaseException:
            del _pending[handle]  # it failed on every rank (check round) or here: nothing to wait for
            raise
        pending.works = [w for w in (works if isinstance(works, (list, tuple)) else [works]) if w is not None]


def _get(handle: int) -> _Pending:
    try:
        return _pending[handle]
    except (KeyError, TypeError):
        raise HorovodValueError(f"handle {handle!r} is unknown or was already synchronized; "
                                "pass the value an hvd.*_async call returned, once") from None


def poll(handle: int) -> bool:
    """True when the operation behind `handle` has finished (synchronize() will not block)."""
    _get(handle)
    start_submitted()
    return all(work.is_completed() for work in _get(handle).works)


def synchronize(handle: int):
    """Wait for the operation behind `handle` and return its result."""
    _get(handle)
    start_submitted()
    pending = _pending.pop(handle)
    wait_all(pending.works)
    return pending.finish()


def forget_all() -> None:
    """shutdown(): operations never started are dropped with their handles."""
    _pending.clear()
