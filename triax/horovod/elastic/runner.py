"""`@hvd.elastic.run`: run the training function, and run it again after every reset.

Under `triax horovodrun`'s elastic driver this is Horovod's loop, inside the same processes: sync
the state from rank 0 and call the function; if a collective fails (HorovodInternalError: a worker
was lost) go back to the last commit; if the hosts changed (HostsUpdatedInterrupt, raised at a
commit) keep the state as it is; then leave the job (hvd.shutdown), join the next round
(hvd.init, which asks the driver for this worker's new rank), call the reset callbacks and loop.
A worker the driver has no slot for leaves with one line and exit code 0.

Under torchrun the agent restarts the processes instead: on every (re)start, init, reload the
last commit if this job made one, sync all ranks from rank 0, call the reset callbacks after a
restart, then train once.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TYPE_CHECKING

from triax.horovod import basics, lifecycle
from triax.horovod.elastic import worker as elastic_worker
from triax.horovod.errors import HorovodInternalError, HostsUpdatedInterrupt, WorkerRemoved
from triax.runtime.rendezvous import restart_count

if TYPE_CHECKING:
    from triax.horovod.elastic.state import State


def run(func: Callable):
    """Decorate `train(state, ...)`; see the module's docstring."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any):
        if not basics.is_initialized():
            lifecycle.init()
        if not elastic_worker.under_driver():
            state.load_committed()
            state.sync()
            if restart_count() > 0:
                state.on_reset()
            return func(state, *args, **kwargs)
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            lifecycle.shutdown()
            try:
                lifecycle.init()
            except WorkerRemoved as removed:
                sys.stderr.write(f"hvd.elastic: {removed}\n")  # one write: other workers share the terminal
                sys.stderr.flush()
                raise SystemExit(0) from None
            state.on_reset()

    return wrapper
