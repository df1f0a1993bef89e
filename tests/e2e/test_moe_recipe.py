"""A 30-step fine-tune of a tiny random Mixtral checkpoint in triax against a plain transformers loop
of the same recipe: the same checkpoint, torch's AdamW with the same hyper-parameters, transformers'
own cosine schedule, the same gradient clipping, the load-balancing loss at the same coefficient,
and the very windows triax trained on in the same order (read back from debug.sample_log). Their
validation losses agree and fall. Then `triax eval` and `triax generate` on that run."""

import json

import pytest
import torch

from support.forked import launch
from support.helpers import tiny_overrides, train
from support.fine_tune_recipe import Recipe, check_falls_as_transformers
from support.moe_checkpoints import save_checkpoint

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

BLOCK, BATCH, STEPS, EVERY = 32, 4, 30, 10
LR, WARMUP, BETAS, WEIGHT_DECAY, CLIP, AUX = 3e-3, 3, (0.9, 0.95), 0.1, 1.0, 0.02
# The two sides compute the same functions with different kernels (triax's grouped expert matmul
# and attention against transformers' own), so they differ by fp32 round-off, which 30 Adam steps
# carry forward: measured under 1e-7 relative on these validation losses. 1e-5 (the bound
# for the same weights) leaves room for other kernels, while a wrong recipe moves them by more:
# the router loss left out on one side moved them by 7e-5 to 8e-5, a 10% lower learning rate by 2e-2
# to 4e-2 (both measured).
TOLERANCE = 1e-5
# The same recipe as a plain loop over transformers' model (tests/support/fine_tune_recipe.py).
LOOP = Recipe(block=BLOCK, batch=BATCH, steps=STEPS, every=EVERY, lr=LR, warmup=WARMUP, betas=BETAS,
              weight_decay=WEIGHT_DECAY, clip=CLIP, aux=AUX)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, tiny_corpus):
    """(checkpoint directory, run directory, triax's validation losses by step, sample log path)."""
    root = tmp_path_factory.mktemp("mixtral_recipe")
    save_checkpoint(root / "hf", "mixtral", tiny_corpus)
    run_dir, log = root / "run", root / "samples"
    train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(root / "hf"), "data.block_size": BLOCK, "trainer.batch_size": BATCH,
        "trainer.max_steps": STEPS, "trainer.eval_every": EVERY, "trainer.eval_batches": 0, "trainer.log_every": EVERY,
        "optim.lr": LR, "optim.min_lr": 0.0, "optim.warmup_steps": WARMUP, "optim.schedule": "cosine_hf",
        "optim.betas": f"[{BETAS[0]},{BETAS[1]}]", "optim.weight_decay": WEIGHT_DECAY, "optim.decay": "all",
        "trainer.grad_clip": CLIP, "model.router_aux_loss_coef": AUX, "parallel.dp_replicate": 1,
        "debug.sample_log": str(log)}), timeout=600)
    val = {r["step"]: r["val_loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "val_loss" in r}
    return root / "hf", run_dir, val, f"{log}.rank0"


def test_a_30_step_fine_tune_falls_as_transformers_same_recipe_does(fine_tuned, tiny_corpus):
    directory, _, ours, sample_log = fine_tuned
    # Both fall: from the checkpoint's own loss, step after step.
    check_falls_as_transformers(LOOP, directory, tiny_corpus, ours, sample_log, TOLERANCE)


def test_triax_eval_of_the_run_is_its_own_validation_loss(fine_tuned):
    """`triax eval RUN` scores the run's last snapshot over the whole validation split: the number
    the trainer logged at its last step, over the same windows."""
    _, run_dir, ours, _ = fine_tuned
    out = launch(1, ["-m", "triax", "eval", str(run_dir), "--json"], timeout=240).stdout
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert result["loss"] == pytest.approx(ours[STEPS], rel=1e-5)


def test_triax_generate_writes_the_fine_tuned_model_s_greedy_text(fine_tuned, tmp_path, capsys):
    """`triax generate RUN --tokens N --greedy` prints the text transformers' greedy decoding of the
    run's export writes."""
    from tokenizers import Tokenizer

    from triax.commands.cli import main as triax_main

    directory, run_dir, _, _ = fine_tuned
    prompt = "the quick brown"
    assert triax_main(["generate", str(run_dir), "--prompt", prompt, "--tokens", "20", "--greedy"]) == 0
    ours = capsys.readouterr().out.rstrip("\n")
    assert triax_main(["export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"]) == 0
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    prompt_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
    # triax draws only ids the tokenizer has (the checkpoint's vocabulary may be larger): so must transformers.
    unused = list(range(tokenizer.get_vocab_size(), model.config.vocab_size))
    theirs = model.generate(prompt_ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                            suppress_tokens=unused or None)
    assert theirs.shape[1] == prompt_ids.shape[1] + 20
    assert ours.startswith(prompt) and len(ours) > len(prompt)
    assert ours == tokenizer.decode(theirs[0].tolist(), skip_special_tokens=False)
