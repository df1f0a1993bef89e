"""The Accelerator door's errors: each is a TriaxError and the built-in class Accelerate raises
in the same situation, so `except ValueError` in a script written for Accelerate still works."""

from triax.errors import TriaxError, UnsupportedFeatureError  # noqa: F401 - the Accelerator door raises it too


class AcceleratorValueError(TriaxError, ValueError):
    """A wrong value: an option, a shape, a key, a directory that exists or does not."""


class AcceleratorTypeError(TriaxError, TypeError):
    """An object of a kind the Accelerator cannot use here."""


class AcceleratorRuntimeError(TriaxError, RuntimeError):
    """Something failed on some process; raised on every process together so none is left waiting."""


def _accelerate_operation_error() -> type:
    """Accelerate's DistributedOperationException when Accelerate is installed, so a script that
    catches it (keeping Accelerate's import) catches triax's; otherwise triax's own base."""
    try:  # deferred: Accelerate is an optional dependency
        from accelerate.utils.operations import DistributedOperationException as accelerate_class
    except ImportError:  # Accelerate is optional: triax then stands alone
        return Exception
    return accelerate_class


class DistributedOperationException(AcceleratorValueError, _accelerate_operation_error()):
    """A collective got data whose structure, dtypes or shapes differ between processes (raised on
    every process, before any data moves). Also a ValueError, and, when Accelerate is installed,
    Accelerate's own DistributedOperationException."""




def _corrupt_base():
    from triax.checkpoint import SnapshotCorruptError

    return SnapshotCorruptError


class StateCorruptError(_corrupt_base(), ValueError):
    """A checkpoint's Accelerator state is damaged or was not written by save_state (also a
    triax.checkpoint.SnapshotCorruptError)."""
