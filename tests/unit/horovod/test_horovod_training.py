"""The classic Horovod training script: 2 processes end with the same model as 1 process that
sees the same global batch.

The reference runs as a plain `python train.py` (one process, no launcher). The script scales
the learning rate by hvd.size(), so the reference gets base_lr x 2 to match the 2-process run.
The 2-process runs start under `triax horovodrun` (plain, backward_passes_per_step=2, fp16
compression) and under OpenMPI's `mpirun` when it is installed.
"""

import shutil
import sys

import pytest
import torch

from support.helpers import assert_adam_close
from support.horovod_support import WORKERS, child_env
from triax.runtime.rendezvous import free_port
from triax.testing import run

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess

SCRIPT = str(WORKERS / "train.py")


# train.py: Adam at lr 0.02 (0.01 x 2 processes) for 2 epochs of 4 steps.
LEARNING_RATES = [0.02] * 8


def assert_same_model(got: dict, expected: dict, dtype="float32"):
    assert_adam_close(got, expected, LEARNING_RATES, dtype)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "one.pt"
    run([sys.executable, SCRIPT, "--out", str(out), "--base-lr", "0.02"], env=child_env(), timeout=300)
    return torch.load(out)["plain"]


def test_two_processes_under_horovodrun_equal_one(one_process, tmp_path):
    out = tmp_path / "two.pt"
    run([sys.executable, "-m", "triax", "horovodrun", "-np", "2", sys.executable, SCRIPT,
         "--out", str(out), "--variants", "plain,accumulate,fp16"], env=child_env(), timeout=300)
    results = torch.load(out)
    # Same arithmetic in a different order (allreduce of two half-batch means): float32 rounding.
    assert_same_model(results["plain"]["model"], one_process["model"])
    # backward_passes_per_step=2: two half-size backward passes per rank, one allreduce.
    assert_same_model(results["accumulate"]["model"], one_process["model"])
    # fp16 on the wire rounds each gradient to ~3 significant digits.
    assert_same_model(results["fp16"]["model"], one_process["model"], dtype="float16")
    assert results["plain"]["loss"] == pytest.approx(one_process["loss"], rel=1e-5)


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="mpirun not installed (apt-get install openmpi-bin; see .ci/apt-packages.txt)")
def test_two_processes_under_mpirun_equal_one(one_process, tmp_path):
    out = tmp_path / "mpi.pt"
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # mpirun passes on only the variables named with -x; the kernel choice too, so the workers
    # run with the ATEN_CPU_CAPABILITY the suite was started with.
    forwarded = [arg for name in ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "OMP_NUM_THREADS",
                                  "ATEN_CPU_CAPABILITY") if name in env
                 for arg in ("-x", name)]
    run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", *forwarded,
         sys.executable, SCRIPT, "--out", str(out)], env=env, timeout=300)
    assert_same_model(torch.load(out)["plain"]["model"], one_process["model"])
