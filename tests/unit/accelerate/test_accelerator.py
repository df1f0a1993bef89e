"""triax.Accelerator with real processes: N processes equal 1, accumulation equals a large batch,
gather_for_metrics is exact, save_state/load_state resumes bitwise."""

import json
import os
import sys

import pytest
from safetensors.torch import load_file

from support import forked
from support.helpers import assert_adam_close, assert_bitwise_equal
from triax.testing import quiet_env, run, run_torchrun
from support import ACCELERATE_SCRIPTS_DIR, REPO_DIR

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess

ROOT = REPO_DIR
LOOP = os.path.join(ACCELERATE_SCRIPTS_DIR, "loop.py")


def env(tmp_path):
    # Children import this checkout's triax, and launch reads no user config.
    return quiet_env(PYTHONPATH=ROOT, TRIAX_CONFIG_FILE=str(tmp_path / "no-config.yaml"))


def forked_loop(tmp_path, out, *args, nproc=1):
    """loop.py as a job of `nproc` processes started the way torchrun starts them (forked.py)."""
    forked.launch(nproc, [LOOP, "--out", str(out), *args], env=env(tmp_path), timeout=240)


def launch(tmp_path, out, *args, nproc=2):
    """loop.py through `triax launch`, the Accelerator door's own launcher."""
    run([sys.executable, "-m", "triax", "launch", "--num-processes", str(nproc), "--main-process-port", "0",
         LOOP, "--out", str(out), *args], env=env(tmp_path), timeout=240)


def records(out):
    return [json.load(open(os.path.join(out, name))) for name in sorted(os.listdir(out)) if name.endswith(".json")]


# loop.py: AdamW at lr 1e-2 / (1 + step), 8 optimizer steps. N processes x batch b equal one process
# x batch N*b when the schedule advances once per update (triax's scheduler_steps="per_update");
# Accelerate's default rule advances it N times, for a schedule written for batch b on one process.
PER_UPDATE = ("--scheduler-steps", "per_update")
LOOP_LEARNING_RATES = [1e-2 / (1 + step) for step in range(8)]


def assert_close_weights(a_dir, b_dir, exact=False):
    a, b = load_file(os.path.join(a_dir, "weights.safetensors")), load_file(os.path.join(b_dir, "weights.safetensors"))
    if exact:
        assert_bitwise_equal(a, b)
    else:
        assert_adam_close(a, b, LOOP_LEARNING_RATES)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, global batch 16, two epochs of 64 samples (8 updates)."""
    tmp = tmp_path_factory.mktemp("single")
    forked_loop(tmp, tmp / "out", "--batch-size", "16", "--eval", *PER_UPDATE)
    return tmp / "out"


def test_launch_two_processes_equals_one_and_gathers_each_sample_once(tmp_path, one_process):
    launch(tmp_path, tmp_path / "out", "--batch-size", "8", "--eval", *PER_UPDATE)
    assert_close_weights(one_process, tmp_path / "out")
    reference = records(one_process)[0]
    ranks = records(tmp_path / "out")
    assert [r["num_processes"] for r in ranks] == [2, 2]
    for record in ranks:
        assert record["optimizer_steps"] == reference["optimizer_steps"] == 8
        # 23 evaluation samples in global batches of 8: the last batch is padded with one repeat,
        # which gather_for_metrics drops, so each sample appears exactly once on every process.
        assert sorted(record["gathered_ids"]) == list(range(23))
        assert record["gathered_ids"] == reference["gathered_ids"]


def test_accumulate_two_processes_four_steps_equals_one_large_batch(tmp_path, one_process):
    # Plain torchrun (no triax launch), and the script creates the process group itself before
    # the Accelerator: 2 processes x batch 2 x 4 micro-steps = global batch 16.
    run_torchrun(2, [LOOP, "--out", str(tmp_path / "out"), "--batch-size", "2", "--accumulate", "4",
                     "--init-group", *PER_UPDATE],
                 env=env(tmp_path), timeout=240)
    assert_close_weights(one_process, tmp_path / "out")
    for record in records(tmp_path / "out"):
        assert record["batches_per_epoch"] == 16
        assert record["optimizer_steps"] == 8
        assert record["scheduler_steps"] == record["optimizer_steps"]


def test_save_state_load_state_mid_epoch_is_bitwise(tmp_path):
    # Dropout makes the result depend on the random streams, which must be restored too.
    common = ["--batch-size", "8", "--dropout", "0.2", "--epochs", "2"]
    # The reference run saves one batch into its second epoch (64 samples / global batch 16 =
    # 4 batches per epoch) and goes on; a fresh run loads that and must finish identically.
    forked_loop(tmp_path, tmp_path / "full", *common, "--save-at", "5", "--save", str(tmp_path / "ckpt"), nproc=2)
    assert os.path.isfile(tmp_path / "ckpt" / "model.safetensors")  # Accelerate's folder layout
    forked_loop(tmp_path, tmp_path / "resumed", *common, "--resume", str(tmp_path / "ckpt"), nproc=2)
    assert_close_weights(tmp_path / "full", tmp_path / "resumed", exact=True)
    for full, resumed in zip(records(tmp_path / "full"), records(tmp_path / "resumed")):
        assert resumed["losses"] == full["losses"][5:]
        assert resumed["optimizer_steps"] == full["optimizer_steps"] == 8
        assert resumed["scheduler_steps"] == full["scheduler_steps"]


def test_fsdp_two_processes_equals_one(tmp_path, one_process):
    # parallel=fsdp reaches the Accelerator from `triax launch --parallel` through the environment.
    run([sys.executable, "-m", "triax", "launch", "--num-processes", "2", "--main-process-port", "0",
         "--parallel", "fsdp", LOOP, "--out", str(tmp_path / "out"), "--batch-size", "8", "--eval", *PER_UPDATE],
        env=env(tmp_path), timeout=240)
    assert_close_weights(one_process, tmp_path / "out")
    for record in records(tmp_path / "out"):
        assert record["optimizer_steps"] == 8 and sorted(record["gathered_ids"]) == list(range(23))
