"""`triax launch` under a scheduler's signals, on one machine (the Slurm tests do it across nodes):
SIGTERM (scancel, a requeue) and SIGUSR1 (Slurm's warning before the time limit, which torchrun's
agent does not pass on) stop the workers with a snapshot, and launch itself exits 0 because every
worker did; torchrun alone exits 1 there."""

import re
import signal
import subprocess
import sys
import time

import pytest

from support.helpers import tiny_overrides
from triax import checkpoint
from triax.runtime.rendezvous import free_port
from triax.testing import quiet_env
from support import REPO_DIR

pytestmark = pytest.mark.multiprocess

REPO = REPO_DIR


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_stop_exits_0_at_every_level(tmp_path, tiny_corpus, signum):
    overrides = tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.max_steps": 100000, "trainer.log_every": 1,
                                                                  "trainer.save_every": 0})
    log = open(tmp_path / "launch.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "triax", "launch", "--num-processes", "2", "--main-process-port",
                                str(free_port()), "-m", "triax", "train", *overrides],
                               stdout=log, stderr=subprocess.STDOUT, env=quiet_env(PYTHONPATH=REPO), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"step [3-9]/", (tmp_path / "launch.log").read_text()):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.2)
        process.send_signal(signum)
        code = process.wait(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    text = (tmp_path / "launch.log").read_text()
    name = signal.Signals(signum).name
    assert code == 0, text[-3000:]
    assert f"received {name}" in text, text[-3000:]
    # Rank 0 says why: the signal, or another rank's when that one handled it first.
    assert re.search(rf"stopped by ({name}|a signal on another rank) after step", text), text[-3000:]
    assert checkpoint.latest_snapshot(str(tmp_path / "run" / "snapshots")) is not None
    if signum == signal.SIGTERM:  # the agent got it; USR1 only went through it to the workers
        assert f"triax launch: stopped by {name}; all 2 workers exited 0" in text, text[-3000:]
