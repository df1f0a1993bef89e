"""One agreement on failure across ranks, used by the trainer, the Accelerator and the snapshots.

A block that may fail on some ranks only (rank 0 writing a file, one rank reading its own RNG
file) is followed by an agreement every rank takes part in: if the block failed anywhere, every
rank raises. Without it a rank that raises alone leaves the others waiting in their next
collective until the process group's timeout.
"""

from __future__ import annotations

import contextlib

from triax.runtime.shared_decisions import all_gather_bytes, any_rank
from triax.errors import TriaxError
from triax.runtime.process_group import is_distributed


class RankFailedError(TriaxError, RuntimeError):
    """Another rank failed in a step every rank had to finish; that rank reports its own error."""


@contextlib.contextmanager
def raise_together(doing: str, failed_elsewhere: type[BaseException] = RankFailedError):
    """Run the block, then agree on its outcome (a collective: every rank enters, also a rank
    with nothing to do, which runs an empty block). A rank whose block raised raises its own
    error again; every other rank raises `failed_elsewhere` (the error class its door promises)
    naming the lowest failing rank and that rank's error: "rank 0 failed while <doing> (OSError:
    ...)"."""
    failure = None
    try:
        yield
    except BaseException as error:  # agreed on below, then raised again unchanged
        failure = error
    agreed = first_failure(failure)
    if failure is not None:
        raise failure
    if agreed is not None:
        rank, message = agreed
        raise failed_elsewhere(f"rank {rank} failed while {doing} ({message})")


def first_failure(error: BaseException | None) -> tuple[int, str] | None:
    """A collective (every rank calls it): None when `error` is None on every rank, else the lowest
    failing rank and the first line of its error ("OSError: ..."), the same on every rank."""
    if not any_rank(error is not None):
        return None
    message = "" if error is None else f"{type(error).__name__}: {error}".splitlines()[0][:500]
    if not is_distributed():
        return 0, message
    messages = all_gather_bytes(message.encode())
    return next((rank, text.decode(errors="replace")) for rank, text in enumerate(messages) if text)
