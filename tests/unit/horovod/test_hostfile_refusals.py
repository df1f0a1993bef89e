"""A Horovod hostfile that is a FIFO is refused at once (not read forever); a link the user names is read."""

import os

import pytest


def test_hostfile_that_is_a_fifo_is_refused_at_once(tmp_path):
    from triax.errors import TriaxError
    from triax.horovod.hosts import parse_hosts

    import signal

    def expired(*_):
        raise TimeoutError("blocked on the FIFO")

    os.mkfifo(tmp_path / "hosts")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(30)
    try:
        with pytest.raises(TriaxError, match="not a regular file"):
            parse_hosts(None, str(tmp_path / "hosts"), None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    (tmp_path / "real").write_text("localhost slots=2\n")
    os.symlink(tmp_path / "real", tmp_path / "link")  # the user's own argument: a link they name is read
    assert parse_hosts(None, str(tmp_path / "link"), None) == [("localhost", 2)]
