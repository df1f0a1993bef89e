"""Same seed, same numbers: a script run on triax's Accelerator gives Hugging Face Accelerate's
numbers bit for bit, in one process and in two. Every random draw a prepared dataloader makes
(the shuffling seed, the workers' base seed, the per-loader generator and its synchronisation, a
collate function's draws one batch ahead) must come from the same generator at the same moment,
or dropout masks, orders and losses drift apart.

Each case runs the same script twice, once per library (tests/support/accelerate_scripts/), and compares
what it wrote: batches, digests of torch's generator state, losses, evaluations, final weights.
"""

import json
import os

import pytest

from support.forked import launch
from triax.testing import quiet_env
from support import ACCELERATE_SCRIPTS_DIR, REPO_DIR

pytest.importorskip("accelerate")
pytestmark = pytest.mark.multiprocess

ROOT = REPO_DIR
SCRIPTS = ACCELERATE_SCRIPTS_DIR
LIBRARIES = ("triax", "accelerate")


def run(script, nproc, workdir, *args, library):
    # ACCELERATE_USE_CPU: Accelerate runs several CPU processes only when told to use the CPU.
    env = quiet_env(PYTHONPATH=ROOT, ACCELERATE_USE_CPU="1", HF_HUB_OFFLINE="1")
    launch(nproc, [os.path.join(SCRIPTS, script), "--library", library, *args], env=env, timeout=300,
           cwd=str(workdir))


def load(path):
    with open(path) as handle:
        return json.load(handle)


@pytest.mark.parametrize("nproc", [1, 2])
def test_prepared_dataloaders_draw_what_accelerate_draws(tmp_path, nproc):
    """Shuffled or not, seedable sampler or not, a generator of the DataLoader's own, a batch
    sampler, drop_last, uneven and split batches, a stream read by every process or dispatched
    from process 0, random draws in a collate function and in a worker: the same batches on every
    process, and torch's generator in the same state after preparing and after each pass."""
    for library in LIBRARIES:
        run("orders.py", nproc, tmp_path, "--out", str(tmp_path / library), library=library)
    for rank in range(nproc):
        ours, theirs = (load(tmp_path / library / f"rank_{rank}.json") for library in LIBRARIES)
        assert ours.keys() == theirs.keys()
        differing = [case for case in theirs if ours[case] != theirs[case]]
        assert not differing, {case: (ours[case], theirs[case]) for case in differing}


def train(tmp_path, nproc, library, name, *args):
    out = tmp_path / library / name
    run("train_like_examples.py", nproc, tmp_path, "--output_dir", str(out), *args, library=library)
    return out


def assert_same_run(triax_dir, accelerate_dir, nproc):
    from safetensors.torch import load_file

    for rank in range(nproc):
        ours, theirs = load(triax_dir / f"result_{rank}.json"), load(accelerate_dir / f"result_{rank}.json")
        assert ours == theirs  # losses, gathered evaluations, torch's next draw after each epoch: bitwise
    ours, theirs = load_file(triax_dir / "weights.safetensors"), load_file(accelerate_dir / "weights.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(ours[name].equal(theirs[name]) for name in ours)


def listing(folder):
    """What a checkpoint folder holds, as Accelerate would list it (triax's manifest is an addition)."""
    return sorted(name for name in os.listdir(folder) if name != "triax_manifest.json")


def test_training_with_dropout_and_accumulation_resumes_as_accelerate_two_processes(tmp_path):
    """2 processes, dropout, accumulation over 2 batches, a checkpoint every 4 steps: the run, and
    runs resumed at an epoch boundary (step 8 of 8 per epoch) and mid-epoch (step 12) with
    load_state + skip_first_batches, end with Accelerate's numbers and weights bitwise. The
    checkpoints cross over: a run resumed on triax from Accelerate's folder, and on Accelerate from
    triax's, each end bitwise equal to Accelerate resuming from its own; the folders hold the same
    files, and automatic naming with total_limit=2 leaves the same checkpoint_<n> folders."""
    from safetensors.torch import load_file

    common = ["--gradient_accumulation_steps", "2"]
    for library in LIBRARIES:
        full = train(tmp_path, 2, library, "full", *common, "--checkpointing_steps", "4", "--automatic_naming", "2")
        for step in (8, 12):
            train(tmp_path, 2, library, f"resumed_{step}", *common, "--resume_from_checkpoint", str(full / f"step_{step}"))
    for library, other in (("triax", "accelerate"), ("accelerate", "triax")):
        train(tmp_path, 2, library, "crossed_12", *common, "--resume_from_checkpoint",
              str(tmp_path / other / "full" / "step_12"))
    for name in ("full", "resumed_8", "resumed_12"):
        assert_same_run(tmp_path / "triax" / name, tmp_path / "accelerate" / name, 2)
    for library in LIBRARIES:
        assert_same_run(tmp_path / library / "crossed_12", tmp_path / "accelerate" / "resumed_12", 2)

    ours, theirs = (tmp_path / library / "full" for library in LIBRARIES)
    assert listing(ours / "step_12") == listing(theirs / "step_12") == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    assert os.path.isfile(ours / "step_12" / "triax_manifest.json")
    saved = [load_file(folder / "step_12" / "model.safetensors") for folder in (ours, theirs)]
    assert saved[0].keys() == saved[1].keys() and all(saved[0][k].equal(saved[1][k]) for k in saved[0])
    automatic = [listing(folder / "project" / "checkpoints") for folder in (ours, theirs)]
    # 6 saves during the run, then 3 more (iterations 6, 7, 8): the last 2 remain
    assert automatic[0] == automatic[1] == ["checkpoint_7", "checkpoint_8"]


def test_training_with_seedable_sampler_resumes_from_an_epoch_as_accelerate_one_process(tmp_path):
    """One process, use_seedable_sampler with set_epoch, a checkpoint every epoch, resumed from
    the first epoch's: Accelerate's numbers and weights bitwise."""
    for library in LIBRARIES:
        full = train(tmp_path, 1, library, "full", "--use_seedable_sampler", "--checkpointing_steps", "epoch")
        train(tmp_path, 1, library, "resumed", "--use_seedable_sampler", "--resume_from_checkpoint",
              str(full / "epoch_0"))
    for name in ("full", "resumed"):
        assert_same_run(tmp_path / "triax" / name, tmp_path / "accelerate" / name, 1)
