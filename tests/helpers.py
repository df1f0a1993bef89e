"""Shared pieces of the trainer tests."""

import sys

from triax import checkpoint
from triax.train.config import compose_config, snapshot_root
from triax.testing import run, run_torchrun


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


def assert_same_weights(a, b, atol=1e-6, rtol=1e-5):
    import torch

    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
