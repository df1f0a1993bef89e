"""FairScale's Pipe raises `TypeError`, `ValueError`, `IndexError` and, for skip connections,
`RuntimeError`; triax raises the same built-in classes, each also a `TriaxError` (one clear line
on the command line)."""

from __future__ import annotations

from triax.errors import TriaxError


class PipeValueError(TriaxError, ValueError):
    """A bad value: balance, chunks, checkpoint mode, devices, partitions."""


class PipeTypeError(TriaxError, TypeError):
    """A wrong type: a module that is not nn.Sequential, inputs/outputs that are not tensors,
    moving a Pipe to another device."""


class PipeIndexError(TriaxError, IndexError):
    """A layer index out of range, or fewer devices than partitions (as FairScale)."""


class PipeRuntimeError(TriaxError, RuntimeError):
    """A skippable layer broke its declaration at run time: stashed or popped a name it did not
    declare, or left a declared one unused."""
