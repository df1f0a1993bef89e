"""A collective that failed because a peer is gone, said in one line with the peer's name.

When a node dies (a lost machine, a killed job step) its sockets close, and gloo on the ranks left
raises a RuntimeError such as `[.../pair.cc:537] Read error [10.214.9.3]:65159: Connection reset by
peer ... GLHF!` from whichever collective was running. That is not a bug of the run but an event a
person acts on, so it becomes one line naming the peer's address and, where it resolves, its host
name (the node a scheduler also names).
"""

from __future__ import annotations

import re
import socket

from triax.errors import TriaxError

# gloo's words for a peer that went away, and the [address]:port it names before or after them.
_LOST = re.compile(r"\[(?P<address>[0-9A-Fa-f.:]+)\]:(?P<port>\d+)[^\n]*?(?:Connection reset by peer|"
                   r"Connection closed by peer|Broken pipe)|(?:Connection closed by peer|Connection reset by peer)"
                   r" \[(?P<address2>[0-9A-Fa-f.:]+)\]:(?P<port2>\d+)")


class PeerLostError(TriaxError, RuntimeError):
    """A collective failed because another process of the job (or its node) is gone."""


def lost_peer_message(error: BaseException) -> str | None:
    """One line for `error` if it says a peer's connection closed, else None."""
    found = _LOST.search(str(error))
    if not found:
        return None
    address = found.group("address") or found.group("address2")
    try:
        host = socket.gethostbyaddr(address)[0]
    except OSError:
        host = None
    where = f"{address} ({host})" if host and host != address else address
    return (f"a collective failed because the connection to {where} closed: the process there, or its node, "
            "is gone (see its own output or the scheduler's); start the same command again to resume from the "
            "newest snapshot")
