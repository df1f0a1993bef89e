"""Collectives that end cleanly at exit: every collective triax starts from Python is kept here."""

from __future__ import annotations

import atexit
import ctypes
import datetime
from typing import Iterable, TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Work

# The latest collectives triax started, kept until the process ends (see keep_until_exit).
_kept_works: list = []
EXIT_WAIT_SECONDS = 30


def keep_until_exit(works: Iterable[Work]) -> None:
    """Hold on to these torch.distributed works (async collectives) so the interpreter never
    finalizes while gloo's worker thread still needs the GIL for them.

    A gloo work started from Python carries Python state, and whichever thread drops the last
    reference to it needs the GIL to release that state; so does a `future.then` callback once it
    has run. If that thread is gloo's and the main thread has meanwhile run off the end of the
    script, CPython is finalizing and ends the thread with pthread_exit, whose unwinding through
    C++ aborts the process after a run that succeeded ("terminate called without an active
    exception", exit -6). So the works are kept here; `_finish_works_before_exit` waits for them
    (a work is marked finished only after its callbacks are released) and never lets them go.
    Works already finished are dropped on the next call, long after gloo is done with them."""
    _kept_works[:] = [work for work in _kept_works if not work.is_completed()]
    _kept_works.extend(works)


def wait_and_keep(work: Work) -> None:
    """Wait for one collective started with async_op=True, then keep it until exit."""
    work.wait()
    keep_until_exit([work])


def finish_all() -> None:
    """Wait for every kept work (a failed or timed-out one was already reported where it ran)."""
    for work in _kept_works:
        try:
            # Work.wait releases the GIL, which gloo's worker thread needs to finish the work.
            work.wait(datetime.timedelta(seconds=EXIT_WAIT_SECONDS))
        except Exception:
            pass


def release_all() -> None:
    """Finish and let go of every kept work: for the teardown of the process group
    (process_group.shutdown_distributed), once gloo's threads are done with them. A kept work holds
    gloo's connections (its context, with the sockets and the thread serving them) open after the
    group itself is destroyed: peers would not see this rank leave."""
    finish_all()
    _kept_works.clear()


@atexit.register
def _finish_works_before_exit() -> None:
    finish_all()
    # A reference the interpreter never drops: no kept work is destroyed during finalization.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_kept_works))
