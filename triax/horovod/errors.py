"""The exceptions Horovod users catch, each also a `TriaxError` so the command line prints one line.

Horovod raises `HorovodInternalError` (a `RuntimeError`) when a collective fails or ranks
disagree, `HostsUpdatedInterrupt` (a `RuntimeError`) when elastic membership changes, and
`ValueError`/`TypeError` for bad arguments, e.g. `hvd.size()` before `hvd.init()`.
"""

from __future__ import annotations

from triax.errors import TriaxError


class HorovodInternalError(TriaxError, RuntimeError):
    """A collective failed: ranks disagreed on it, or a peer is gone (torchrun restarts the job)."""


class HostsUpdatedInterrupt(TriaxError, RuntimeError):
    """Elastic membership changed. `skip_sync` says whether state must be re-synced (as Horovod's)."""

    def __init__(self, skip_sync: bool = False, message: str = "the set of hosts changed"):
        super().__init__(message)
        self.skip_sync = skip_sync


class WorkerRemoved(TriaxError, RuntimeError):
    """The elastic driver gave this worker no slot in the next round (its host was removed or
    blacklisted): Horovod's workers fail hvd.init() with the same words and leave the job."""


class HorovodRunError(TriaxError, RuntimeError):
    """`hvd.run`: a process of the job exited with a non-zero status (Horovod raises RuntimeError)."""


class HorovodValueError(TriaxError, ValueError):
    """A bad argument value (root rank out of range, unknown op, uninitialized Horovod, ...)."""


class HorovodTypeError(TriaxError, TypeError):
    """An argument of the wrong type (not a tensor, not an optimizer, ...)."""


class HorovodAssertionError(TriaxError, AssertionError):
    """Misuse of DistributedOptimizer's step protocol, where Horovod raises AssertionError."""


class HorovodNotImplementedError(TriaxError, NotImplementedError):
    """Something Horovod itself does not support either (e.g. Adasum on 3 ranks)."""
