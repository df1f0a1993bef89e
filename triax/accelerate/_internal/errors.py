"""The Accelerator door's errors: each is a TriaxError and the built-in class Accelerate raises
in the same situation, so `except ValueError` in a script written for Accelerate still works."""

import functools
import sys

from triax.errors import TriaxError, UnsupportedFeatureError  # noqa: F401 - the Accelerator door raises it too


class AcceleratorValueError(TriaxError, ValueError):
    """A wrong value: an option, a shape, a key, a directory that exists or does not."""


class AcceleratorTypeError(TriaxError, TypeError):
    """An object of a kind the Accelerator cannot use here."""


class AcceleratorRuntimeError(TriaxError, RuntimeError):
    """Something failed on some process; raised on every process together so none is left waiting."""


class DistributedOperationException(AcceleratorValueError):
    """A collective got data whose structure, dtypes or shapes differ between processes (raised on
    every process, before any data moves). Also a ValueError, and, when the script imported
    Accelerate, Accelerate's own DistributedOperationException (see distributed_operation_error)."""


def distributed_operation_error(message: str) -> DistributedOperationException:
    """The error to raise: triax's DistributedOperationException, which is also Accelerate's own
    when the script imported Accelerate, so a script that kept Accelerate's `except` catches it.
    Accelerate is never imported here: importing it runs its start-up code (and its warnings) in
    a run whose script does not use it."""
    operations = sys.modules.get("accelerate.utils.operations")
    if operations is None:
        return DistributedOperationException(message)
    return _also_accelerates(operations.DistributedOperationException)(message)


@functools.lru_cache(maxsize=None)
def _also_accelerates(accelerate_class: type) -> type:
    return type("DistributedOperationException", (DistributedOperationException, accelerate_class),
                {"__module__": __name__, "__qualname__": "DistributedOperationException",
                 "__doc__": DistributedOperationException.__doc__})




def _corrupt_base():
    from triax.checkpoint import SnapshotCorruptError

    return SnapshotCorruptError


class StateCorruptError(_corrupt_base(), ValueError):
    """A checkpoint's Accelerator state is damaged or was not written by save_state (also a
    triax.checkpoint.SnapshotCorruptError)."""
