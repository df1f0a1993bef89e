"""A collective that failed because a peer is gone is one line naming the peer (triax.runtime.lost_peers)."""

import pytest

from triax.errors import TriaxError
from triax.runtime.lost_peers import PeerLostError, lost_peer_message


@pytest.mark.parametrize("text, where", [
    ("[/w/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:65159: Connection reset by peer. This is", "127.0.0.1 (localhost)"),
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5400", "127.0.0.1 (localhost)"),
    ("[pair.cc:598] Write error [192.0.2.7]:43000: Broken pipe", "192.0.2.7"),
])
def test_a_closed_peer_is_named(text, where):
    message = lost_peer_message(RuntimeError(text))
    assert message.startswith(f"a collective failed because the connection to {where} closed"), message
    assert "\n" not in message
    assert issubclass(PeerLostError, TriaxError) and issubclass(PeerLostError, RuntimeError)


@pytest.mark.parametrize("text", ["CUDA out of memory", "Connection reset by peer", "[not an address]:12: Connection reset by peer"])
def test_other_errors_are_left_alone(text):
    assert lost_peer_message(RuntimeError(text)) is None
