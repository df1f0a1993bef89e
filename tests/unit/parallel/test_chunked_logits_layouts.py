"""The token loss through the output layer in chunks of positions (parallel.max_logits_mb far below a
micro-batch's logits) computes the same training run as one process holding the whole logits, in
every layout that takes it: one process (eager and compiled), DDP, FSDP2 with activation
checkpointing, tensor parallel (vocabulary-sharded logits under loss_parallel) and context
parallel. The losses logged (training and validation, both in chunks) and the final weights agree.
Kept cheap: a 2-layer, 32-wide GPT, 3 steps, a global batch of 8."""

import json
import os

import pytest

from support.helpers import assert_same_training, train

pytestmark = pytest.mark.multiprocess

STEPS, GLOBAL_BATCH = 3, 8
LOSS_RTOL = 1e-5  # as tests/unit/parallel/test_parallel_layouts.py: the weights agree to ~3e-6
# About 1 KB of fp32 logits at once: chunks of 9 positions of the characters' vocabulary, where
# each micro-batch holds 8 x 16 positions.
CHUNKED = {"parallel.max_logits_mb": 0.001}

# name: (processes, per-data-parallel-rank batch, parallel.* settings)
LAYOUTS = {
    "single": (1, 8, {}),
    "compiled": (1, 8, {"parallel.compile": "true"}),
    "ddp2": (2, 4, {"parallel.dp_replicate": 2}),
    "fsdp2_checkpointed": (2, 4, {"parallel.dp_shard": 2, "parallel.activation_checkpointing": "full"}),
    "tp2": (2, 8, {"parallel.tp": 2}),
    "cp2": (2, 8, {"parallel.cp": 2}),
}


def overrides(run_dir, corpus, batch_size, **extra):
    values = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "data.path": corpus, "data.block_size": 16,
              "trainer.max_steps": STEPS, "trainer.batch_size": batch_size, "trainer.eval_every": STEPS,
              "trainer.eval_batches": 1, "trainer.log_every": 1, "trainer.run_dir": str(run_dir),
              "trainer.sample_tokens": 0, "optim.warmup_steps": 2, "parallel.dp_replicate": 1, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def records(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_corpus):
    """One process, the whole logits (the default limit is far above them)."""
    run_dir = tmp_path_factory.mktemp("whole")
    train(overrides(run_dir, tiny_corpus, GLOBAL_BATCH))
    return run_dir


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_logits_equal_the_whole_in_every_layout(name, tmp_path, tiny_corpus, whole):
    nproc, batch_size, settings = LAYOUTS[name]
    train(overrides(tmp_path, tiny_corpus, batch_size, **settings, **CHUNKED), nproc=nproc, timeout=400)
    ours, theirs = records(tmp_path), records(whole)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    for mine, base in zip(ours, theirs):
        for key in ("loss", "val_loss"):
            if key in base:
                assert mine[key] == pytest.approx(base[key], rel=LOSS_RTOL), (key, mine["step"])
    assert_same_training(tmp_path, whole)
