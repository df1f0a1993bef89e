"""The Accelerator door's errors: each is a TriaxError and the built-in class Accelerate raises
in the same situation, so `except ValueError` in a script written for Accelerate still works."""

from triax.errors import TriaxError


class AcceleratorValueError(TriaxError, ValueError):
    """A wrong value: an option, a shape, a key, a directory that exists or does not."""


class AcceleratorTypeError(TriaxError, TypeError):
    """An object of a kind the Accelerator cannot use here."""


class AcceleratorRuntimeError(TriaxError, RuntimeError):
    """Something failed on some process; raised on every process together so none is left waiting."""


class UnsupportedFeatureError(TriaxError, NotImplementedError):
    """A part of Accelerate that triax deliberately does not provide; the message names the alternative."""


def _corrupt_base():
    from triax.checkpoint import SnapshotCorruptError

    return SnapshotCorruptError


class StateCorruptError(_corrupt_base(), ValueError):
    """A checkpoint's Accelerator state is damaged or was not written by save_state (also a
    triax.checkpoint.SnapshotCorruptError)."""
