"""Gradient compression (parallel.grad_compression) changes only the rounding of the averaged
gradients (bf16/fp16), or approximates them with error feedback (PowerSGD) and still converges."""

import os

import pytest
import torch

from support.forked import launch
from support.helpers import assert_same_training, final_weights, tiny_overrides, train
from triax.errors import ConfigError
from triax.testing import quiet_env, run_torchrun
from support import REPO_DIR, WORKERS_DIR

REPO = REPO_DIR
WORKER = os.path.join(WORKERS_DIR, "compression_worker.py")


@pytest.fixture(scope="module")
def compression_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression") / "results.pt"
    # PYTHONPATH: the worker is started by path, so it must import this checkout's triax.
    launch(2, [WORKER, str(out)], timeout=240, env=quiet_env(PYTHONPATH=REPO))
    return torch.load(out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, unit_roundoff", [("bf16", 2.0**-8), ("fp16", 2.0**-11)])
def test_cast_compression_equals_uncompressed_within_rounding(compression_runs, name, unit_roundoff):
    exact, compressed = compression_runs["none"]["grads"], compression_runs[name]["grads"]
    changed = False
    for key in exact:
        # Each rank's half is rounded once and the sum once more: a few unit roundoffs of the
        # largest gradient in the tensor bounds the error (cancellation makes it absolute).
        scale = exact[key].abs().max().item()
        torch.testing.assert_close(compressed[key], exact[key], rtol=0,
                                   atol=4 * unit_roundoff * scale, msg=lambda m: f"{key}: {m}")
        changed |= not torch.equal(compressed[key], exact[key])
    assert changed, f"{name} gradients are bit-identical to fp32: the hook did not run"
    # Over 30 steps the rounding does not change where training goes.
    assert compression_runs[name]["losses"][-1] == pytest.approx(compression_runs["none"]["losses"][-1], rel=1e-3)


@pytest.mark.multiprocess
def test_powersgd_converges_like_uncompressed(compression_runs):
    exact, powersgd = compression_runs["none"], compression_runs["powersgd"]
    # The first steps are plain all-reduce (PowerSGD's warm-up)...
    for key in exact["grads"]:
        torch.testing.assert_close(powersgd["grads"][key], exact["grads"][key])
    # ...later ones are low-rank: the weights go elsewhere, the loss falls nearly as far.
    assert (powersgd["weights"]["2.weight"] - exact["weights"]["2.weight"]).abs().max() > 1e-4
    start = exact["losses"][0]
    progress = (start - powersgd["losses"][-1]) / (start - exact["losses"][-1])
    assert progress > 0.8, f"PowerSGD made {progress:.0%} of the uncompressed loss decrease"


@pytest.mark.multiprocess
def test_trainer_passes_compression_to_ddp(tmp_path, tiny_corpus):
    # 2 processes with bf16 gradients vs 1 process (which sends nothing, so is exact): close, not equal.
    train(tiny_overrides(tmp_path / "bf16", tiny_corpus, **{"trainer.batch_size": 4,
                                                             "parallel.grad_compression": "bf16"}), nproc=2)
    train(tiny_overrides(tmp_path / "single", tiny_corpus, **{"trainer.batch_size": 8}), nproc=1)
    compressed, exact = final_weights(tmp_path / "bf16"), final_weights(tmp_path / "single")
    assert_same_training(tmp_path / "bf16", tmp_path / "single", dtype="bfloat16")
    assert any(not torch.equal(compressed[k], exact[k]) for k in exact), "bf16 made no difference"


def test_unknown_compression_is_a_config_error():
    from triax.config import compose_config

    with pytest.raises(ConfigError, match="grad_compression.*'zip'"):
        compose_config(["parallel.grad_compression=zip"])
    with pytest.raises(ConfigError, match="powersgd_rank"):
        compose_config(["parallel.grad_compression=powersgd", "parallel.powersgd_rank=0"])


EXIT_WORKER = os.path.join(WORKERS_DIR, "exit_callback.py")


@pytest.mark.multiprocess
def test_callbacks_on_gloo_finish_before_the_interpreter_exits():
    """A script that ends right after a compressed step exits 0: PyTorch's plain `.then` on a
    gloo future aborts the process (exit -6) when the callback is released after finalization
    has begun; triax's hooks wait for it (comm_hooks.all_reduce_then)."""
    plain = run_torchrun(2, [EXIT_WORKER, "plain"], timeout=120, env=quiet_env(PYTHONPATH=REPO), check=False)
    assert plain.returncode != 0 and "exitcode  : -6" in plain.stderr, (
        "the unprotected script was expected to abort; without that this test proves nothing\n"
        + plain.stdout[-2000:] + plain.stderr[-2000:])
    guarded = run_torchrun(2, [EXIT_WORKER, "triax"], timeout=120, env=quiet_env(PYTHONPATH=REPO), check=False)
    assert guarded.returncode == 0, guarded.stdout[-2000:] + guarded.stderr[-4000:]
    assert "rank 0: callback released" in guarded.stdout
