"""A 30-step fine-tune of a tiny random DeepSeek-V3 checkpoint in triax against a plain transformers
loop of the same recipe (test_moe_recipe.py's: torch's AdamW, transformers' cosine schedule, the same
clipping, the very windows triax trained on, in its order; no router loss, which transformers'
DeepSeek-V3 has none of): their validation losses agree and fall. The same fine-tune under EP x 2
ends at the one-process weights."""

import json

import pytest
import torch

from support.helpers import final_weights, tiny_overrides, train
from support.fine_tune_recipe import Recipe, check_falls_as_transformers
from support.deepseek_checkpoints import save_checkpoint
from test_moe_recipe import BATCH, BETAS, BLOCK, CLIP, EVERY, LR, STEPS, WARMUP, WEIGHT_DECAY

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

# As for Mixtral (test_moe_recipe.py): the two sides differ by fp32 round-off carried over 30 Adam steps.
TOLERANCE = 1e-5
# The same recipe as a plain loop over transformers' model (tests/support/fine_tune_recipe.py).
LOOP = Recipe(block=BLOCK, batch=BATCH, steps=STEPS, every=EVERY, lr=LR, warmup=WARMUP, betas=BETAS,
              weight_decay=WEIGHT_DECAY, clip=CLIP, aux=0.0)


def fine_tune(directory, run_dir, corpus, log=None, nproc=1, **layout):
    train(tiny_overrides(run_dir, corpus, **{
        "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.batch_size": BATCH,
        "trainer.max_steps": STEPS, "trainer.eval_every": EVERY, "trainer.eval_batches": 0, "trainer.log_every": EVERY,
        "optim.lr": LR, "optim.min_lr": 0.0, "optim.warmup_steps": WARMUP, "optim.schedule": "cosine_hf",
        "optim.betas": f"[{BETAS[0]},{BETAS[1]}]", "optim.weight_decay": WEIGHT_DECAY, "optim.decay": "all",
        "trainer.grad_clip": CLIP, "parallel.dp_replicate": 1, **({"debug.sample_log": str(log)} if log else {}),
        **layout}), nproc=nproc, timeout=600)
    return {r["step"]: r["val_loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "val_loss" in r}


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, tiny_corpus):
    """(checkpoint directory, root, triax's validation losses by step, sample log path)."""
    from support.llama_checkpoints import train_tokenizer

    root = tmp_path_factory.mktemp("deepseek_recipe")
    save_checkpoint(root / "hf")
    train_tokenizer(tiny_corpus, root / "hf" / "tokenizer.json")
    val = fine_tune(root / "hf", root / "run", tiny_corpus, log=root / "samples")
    return root / "hf", root, val, f"{root / 'samples'}.rank0"


def test_a_30_step_fine_tune_falls_as_transformers_same_recipe_does(fine_tuned, tiny_corpus):
    directory, _, ours, sample_log = fine_tuned
    # Both fall: from the checkpoint's own loss, step after step.
    check_falls_as_transformers(LOOP, directory, tiny_corpus, ours, sample_log, TOLERANCE)


def test_the_fine_tune_under_ep_ends_at_the_one_process_weights(fine_tuned, tiny_corpus):
    """EP x 2 (each rank half the experts and half the batch) against one process taking the two
    halves as accumulated micro-batches: every final weight within 1e-5 (relative to its tensor's
    largest value)."""
    directory, root, _, _ = fine_tuned
    fine_tune(directory, root / "single2", tiny_corpus, **{"trainer.grad_accum": 2})
    fine_tune(directory, root / "ep2", tiny_corpus, nproc=2, **{"parallel.dp_shard": 2, "parallel.ep": 2})
    one, ep = final_weights(root / "single2"), final_weights(root / "ep2")
    assert one.keys() == ep.keys()
    worst = max(((ep[name] - one[name]).abs().max() / one[name].abs().max().clamp(min=1e-12)).item() for name in one)
    print("largest relative difference after 30 steps:", worst)
    assert worst <= 1e-5, worst
