"""Shared pieces of the tests: a tiny trainer run, and the two ways weights are compared.

Two runs of the *same* computation (a resume, a chaos run, against an uninterrupted one) must be
bitwise equal: `assert_bitwise_equal`. Two runs that compute the same mathematics in a different
order (2 processes against 1, accumulation against a large batch, a parallel layout) agree only to
round-off, and Adam turns round-off into steps: `assert_same_training` compares them at a tolerance
derived from the dtype, the number of steps and the learning rate (see `adam_tolerance`).
"""

import json
import os

import numpy as np
import yaml

from triax import checkpoint
from triax.config import compose_config, snapshot_root
from support.forked import launch

# Relative precision below which two computations of one gradient element are indistinguishable,
# per dtype. Summing the same terms in another order (another process count, another reduction
# tree, another CPU's kernels) changes a gradient element by a few units of round-off of its
# *terms*; where the terms nearly cancel, that is a large fraction of the element itself. Adam
# divides by the element's own running magnitude, so the update inherits that relative error.
# We allow a relative error of 2^-10 per update in fp32 (more than 10^4 times its unit
# round-off), which still separates round-off from a real difference by orders of magnitude: a
# sample moved to another step, a step taken twice or a wrong gradient scale under clipping moves
# a parameter by a sizeable fraction of lr per step.
UPDATE_PRECISION = {"float32": 2.0 ** -10, "bfloat16": 2.0 ** -4, "float16": 2.0 ** -6}
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}

# Parameters whose true gradient is identically zero, by construction of the model: adding the
# same vector to every key shifts each query's attention scores by one constant, and softmax
# ignores constant shifts, so the key projection's bias never changes the loss. Its computed
# gradient is pure round-off, which AdamW normalises into steps of size ~lr in a direction that
# depends on the CPU's kernels and thread count. These are compared only against the bound Adam
# itself guarantees; test_trainer_equivalence.py checks that the gradient really is zero.
ZERO_GRADIENT_SUFFIXES = ("attn.k_proj.bias",)


def tiny_overrides(run_dir, corpus, **extra):
    """A model and run small enough for a test: a few steps of gpt-nano-sized training."""
    values = {
        "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32,
        "data.path": corpus, "data.block_size": 16,
        "trainer.max_steps": 6, "trainer.batch_size": 8, "trainer.eval_every": 0,
        "trainer.log_every": 2, "trainer.run_dir": str(run_dir), "trainer.sample_tokens": 0,
        "optim.warmup_steps": 2,
    }
    values.update(extra)
    return [f"{key}={value}" for key, value in values.items()]


def token_files(directory, vocab_size):
    """Token files in nanoGPT's layout (4,096 random uint16 ids, the first 1,024 again as val.bin)."""
    directory.mkdir()
    tokens = np.random.default_rng(0).integers(0, vocab_size, 4096).astype(np.uint16)
    tokens.tofile(directory / "train.bin")
    tokens[:1024].tofile(directory / "val.bin")
    return directory


def train(overrides, nproc=1, timeout=240, check=True, env=None, cwd=None):
    """`triax train` with these overrides as a job of `nproc` processes (forked: see forked.py)."""
    return launch(nproc, ["-m", "triax", "train", *overrides], timeout=timeout, check=check, env=env, cwd=cwd)


def run_snapshot_root(run_dir, overrides=()):
    """Where the run with these overrides keeps its snapshots (the trainer's own rule)."""
    return snapshot_root(compose_config([f"trainer.run_dir={run_dir}", *overrides]))


def final_weights(run_dir, overrides=()):
    snapshot = checkpoint.latest_snapshot(run_snapshot_root(run_dir, overrides))
    assert snapshot is not None, f"no snapshot in {run_dir}"
    return checkpoint.read_model_tensors(snapshot)


def run_config(run_dir):
    with open(os.path.join(run_dir, "config.yaml")) as handle:
        return yaml.safe_load(handle)


def adam_tolerance(learning_rates, dtype="float32"):
    """(atol, rtol) for parameters after Adam steps with these learning rates, computed twice
    in a different order. Each step moves a parameter by lr_t x m/sqrt(v), and |m/sqrt(v)| is
    about 1, so a relative error p in the update is at most lr_t x p per step (absolute); storing
    the updated weight rounds it once more per step (relative)."""
    steps = len(learning_rates)
    return sum(learning_rates) * UPDATE_PRECISION[dtype], 2 * steps * UNIT_ROUNDOFF[dtype]


# Cancellation has no bound: a gradient element whose terms nearly cancel keeps few correct digits
# (in fp32 too, with enough cancellation), and Adam normalises it into a step of ~lr in a direction
# set by round-off. So per element only Adam's own bound holds; in aggregate, all but a few
# elements of each tensor must agree to the dtype's tolerance. A real difference (a wrong sample,
# a step taken twice, a wrong scale, a tensor not synchronised) moves most elements of a tensor.
OUTLIER_FRACTION = {"float32": 2.0 ** -10, "bfloat16": 2.0 ** -6, "float16": 2.0 ** -6}


def assert_weights_close(a, b, atol, rtol, outliers=0.0, outlier_bound=None, zero_gradient_bound=None):
    """Same names and shapes, finite; each tensor's elements within (atol, rtol), except at most
    max(1, outliers x its size) of them, which must still be within `outlier_bound` (absolute).
    Parameters named in ZERO_GRADIENT_SUFFIXES are held only to zero_gradient_bound when one is given."""
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].shape == b[name].shape, f"{name}: shape {tuple(a[name].shape)} != {tuple(b[name].shape)}"
        assert torch.isfinite(a[name]).all() and torch.isfinite(b[name]).all(), f"{name}: not finite"
        difference = (a[name] - b[name]).abs()
        if zero_gradient_bound is not None and name.endswith(ZERO_GRADIENT_SUFFIXES):
            assert difference.max().item() <= zero_gradient_bound, \
                f"{name}: {difference.max().item()} > {zero_gradient_bound}"
            continue
        if not outliers:
            torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol,
                                       msg=lambda message: f"{name}: {message}")
            continue
        assert difference.max().item() <= outlier_bound, f"{name}: {difference.max().item()} > {outlier_bound}"
        beyond = int((difference > atol + rtol * b[name].abs()).sum())
        allowed = max(1, int(outliers * difference.numel()))
        assert beyond <= allowed, (f"{name}: {beyond} of {difference.numel()} elements differ by more than "
                                   f"atol={atol:.3g}, rtol={rtol:.3g} (largest {difference.max().item():.3g}); "
                                   f"round-off explains at most {allowed}")


def assert_adam_close(a, b, learning_rates, dtype="float32"):
    """Weights after AdamW steps with these learning rates, computed twice in a different order
    (processes, accumulation, layout, gradients sent in `dtype`): see adam_tolerance and
    OUTLIER_FRACTION. A parameter whose true gradient is zero is held only to Adam's bound."""
    atol, rtol = adam_tolerance(learning_rates, dtype)
    # Whatever its gradient, an AdamW step moves a parameter by at most ~lr (2 x lr, generously,
    # with the early bias correction), so two runs differ by at most twice that per step.
    adam_bound = 2 * 2 * sum(learning_rates)
    assert_weights_close(a, b, atol, rtol, outliers=OUTLIER_FRACTION[dtype], outlier_bound=adam_bound,
                         zero_gradient_bound=adam_bound)


def assert_same_training(run_a, run_b, dtype="float32"):
    """The final weights of two trainer runs that must take the same steps in a different order.
    dtype: the precision the gradients were reduced in (bfloat16/float16: gradient compression)."""
    config = run_config(run_b)
    learning_rates = [config["optim"]["lr"]] * config["trainer"]["max_steps"]  # peak lr: an upper bound
    assert_adam_close(final_weights(run_a), final_weights(run_b), learning_rates, dtype)


def assert_bitwise_equal(a, b):
    """A run compared with itself (resumed, restarted, replayed): every bit must agree."""
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, (f"not bitwise equal: {different}; largest differences: "
                           f"{[(n, (a[n] - b[n]).abs().max().item()) for n in different[:3]]}")


def kill_after_snapshot_and_resume(command, run_dir, step=2, timeout=300):
    """Run `command` (a `triax train` command line) in its own session, SIGKILL it once the snapshot of
    `step` exists, run it again to the end, and return that second run's stdout (it must resume)."""
    import signal
    import subprocess
    import time

    from triax.testing import quiet_env

    env = quiet_env(PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not (run_dir / "snapshots" / f"step_{step:08d}").exists():
            assert job.poll() is None and time.monotonic() < deadline, "the run ended before its snapshot"
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    return result.stdout


def eval_token_stream(directory, ids, block_size, tmp_path, capsys):
    """`triax eval DIRECTORY --tokens FILE --block-size N --json` of `ids` (written as uint16 tokens),
    in this process: its JSON result."""
    from triax.commands.cli import main

    path = tmp_path / "val.bin"
    ids.numpy().astype("uint16").tofile(path)
    capsys.readouterr()
    assert main(["eval", str(directory), "--tokens", str(path), "--block-size", str(block_size), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def worker_pids(launcher_pid):
    """{rank: pid} of torchrun's worker processes (its children that carry a RANK variable)."""
    workers = {}
    for task in os.listdir(f"/proc/{launcher_pid}/task"):
        try:
            children = open(f"/proc/{launcher_pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    workers[int(item[5:])] = pid
    return workers
