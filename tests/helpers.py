"""Shared pieces of the tests: a tiny trainer run, and the two ways weights are compared.

Two runs of the *same* computation (a resume, a chaos run, against an uninterrupted one) must be
bitwise equal: `assert_bitwise_equal`. Two runs that compute the same mathematics in a different
order (2 processes against 1, accumulation against a large batch, a parallel layout) agree only to
round-off, and Adam turns round-off into steps: `assert_same_training` compares them at a tolerance
derived from the dtype, the number of steps and the learning rate (see `adam_tolerance`).
"""

import os
import sys

import yaml

from triax import checkpoint
from triax.train.config import compose_config, snapshot_root
from triax.testing import run, run_torchrun

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


def train(overrides, nproc=1, timeout=240, check=True):
    if nproc == 1:
        return run([sys.executable, "-m", "triax", "train", *overrides], timeout=timeout, check=check)
    return run_torchrun(nproc, ["-m", "triax", "train", *overrides], timeout=timeout, check=check)


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


def assert_weights_close(a, b, atol, rtol, zero_gradient_bound=None, outliers=0.0, outlier_bound=None):
    """Same names and shapes; each element within (atol, rtol). Parameters named in
    ZERO_GRADIENT_SUFFIXES are held only to zero_gradient_bound (absolute) when one is given.
    `outliers`: the fraction of all elements allowed outside (atol, rtol), each still within
    `outlier_bound` (absolute) - for gradients sent in a low precision, see assert_same_training."""
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    outside, total, report = 0, 0, []
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
        outside, total = outside + beyond, total + difference.numel()
        if beyond:
            report.append(f"{name}: {beyond} (largest {difference.max().item():.3g})")
    assert outside <= outliers * total, (f"{outside} of {total} elements differ by more than atol={atol:.3g}, "
                                         f"rtol={rtol:.3g}: {'; '.join(report)}")


def assert_same_training(run_a, run_b, dtype="float32"):
    """The final weights of two trainer runs that must take the same steps in a different order
    (processes, accumulation, layout): equal to round-off amplified by AdamW, see adam_tolerance.
    dtype: the precision the gradients were reduced in (bfloat16/float16: gradient compression)."""
    config = run_config(run_b)
    steps, peak = config["trainer"]["max_steps"], config["optim"]["lr"]
    atol, rtol = adam_tolerance([peak] * steps, dtype)
    # Whatever its gradient, an AdamW step moves a parameter by at most ~lr (2 x lr, generously,
    # with the early bias correction), so two runs differ by at most twice that per step. A
    # zero-gradient parameter is held only to this; it still catches a missing, garbage or
    # non-finite tensor.
    adam_bound = 2 * 2 * peak * steps
    # In a low precision, a gradient element whose two halves nearly cancel keeps no correct digit
    # after rounding, and Adam normalises it into a step in any direction: a few such elements
    # may differ up to Adam's bound; all others must agree to the dtype's tolerance.
    lossy = dtype != "float32"
    assert_weights_close(final_weights(run_a), final_weights(run_b), atol, rtol,
                         zero_gradient_bound=adam_bound, outliers=0.01 if lossy else 0.0,
                         outlier_bound=adam_bound)


def assert_bitwise_equal(a, b):
    """A run compared with itself (resumed, restarted, replayed): every bit must agree."""
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, (f"not bitwise equal: {different}; largest differences: "
                           f"{[(n, (a[n] - b[n]).abs().max().item()) for n in different[:3]]}")
