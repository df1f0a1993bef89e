"""`@hvd.elastic.run`: start (or restart) the training function from the last committed state."""

from __future__ import annotations

import functools

from triax.horovod import basics, lifecycle
from triax.horovod.errors import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401  (hvd.elastic.*)
from triax.rendezvous import restart_count


def run(func):
    """Decorate `train(state, ...)`. On every (re)start: init, reload the last commit if this job
    made one, sync all ranks from rank 0, call the reset callbacks after a restart, then train."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not basics.is_initialized():
            lifecycle.init()
        state.load_committed()
        state.sync()
        if restart_count() > 0:
            state.on_reset()
        return func(state, *args, **kwargs)

    return wrapper
