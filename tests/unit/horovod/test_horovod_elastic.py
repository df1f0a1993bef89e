"""hvd.elastic on torchrun: a worker dies once; the restarted job resumes from the last commit and
ends where a run without the failure (one process, same global batch) ends."""

import sys

import pytest

import torch

from support.horovod_support import WORKERS, child_env
from triax.testing import run, run_torchrun

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess

SCRIPT = str(WORKERS / "elastic_train.py")


def test_restart_resumes_from_last_commit(tmp_path):
    run([sys.executable, SCRIPT, "--out", str(tmp_path / "one.pt")], env=child_env(), timeout=300)
    marker = tmp_path / "crashed"
    run_torchrun(2, [SCRIPT, "--out", str(tmp_path / "two.pt"), "--crash-marker", str(marker)],
                 max_restarts=1, env=child_env(), timeout=300)
    assert marker.exists(), "the worker never crashed: the restart path was not exercised"
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    # epochs 0-1 ran in the first attempt, 2-3 after the restart, none twice
    assert two["history"] == [("0", 0), ("0", 1), ("1", 2), ("1", 3)]
    assert two["resets"] == [2]
    assert max((one["model"][k] - two["model"][k]).abs().max().item() for k in one["model"]) < 1e-5
