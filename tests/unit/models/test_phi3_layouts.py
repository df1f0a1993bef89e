"""Phi-3 as a user runs it: a run started from the tiny transformers checkpoint (one step at a
negligible learning rate) scores under `triax eval` as its trainer did, and its `--format hf`
export (q/k/v and gate/up fused back) loads in AutoModelForCausalLM and scores as transformers
scores the checkpoint; that step under TP x 2 or FSDP x 2 equals one process; LoRA on triax's
separate layers exports merged, and `--format peft` refuses in one line."""

import json

import pytest
import torch

from support.forked import launch
from support.helpers import tiny_overrides, train
from support.hf_scoring import tokenizer_validation_ids
from support.phi3_checkpoints import save_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")
pytestmark = pytest.mark.multiprocess

BLOCK = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_corpus):
    directory = tmp_path_factory.mktemp("phi3")
    save_checkpoint(directory, tiny_corpus)
    return directory


def run(run_dir, corpus, checkpoint, nproc=1, **settings):
    """One step from the checkpoint at a negligible learning rate; its metrics records."""
    train(tiny_overrides(run_dir, corpus, **{
        "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 1,
        "trainer.batch_size": 4, "optim.lr": 1e-12, "optim.min_lr": 0.0, "trainer.eval_every": 1,
        "trainer.eval_batches": 0, "parallel.dp_replicate": 1, "trainer.log_every": 1, **settings}),
        nproc=nproc, timeout=300)
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_a_run_from_the_checkpoint_evaluates_and_exports_as_transformers_scores(checkpoint, tmp_path, tiny_corpus):
    from safetensors import safe_open

    from support.hf_scoring import hf_mean_loss

    run_dir = tmp_path / "run"
    record = run(run_dir, tiny_corpus, checkpoint)[-1]
    assert json.load(open(run_dir / "model.json"))["arch"] == "phi3"
    scored = json.loads(launch(1, ["-m", "triax", "eval", str(run_dir), "--json"]).stdout.strip().splitlines()[-1])
    assert scored["loss"] == pytest.approx(record["val_loss"], rel=1e-5)
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"])
    assert json.load(open(tmp_path / "hf" / "config.json"))["architectures"] == ["Phi3ForCausalLM"]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as exported, \
            safe_open(str(checkpoint / "model.safetensors"), "pt") as original:
        assert set(exported.keys()) == set(original.keys())  # qkv_proj and gate_up_proj, as transformers names them
    ids = tokenizer_validation_ids(checkpoint, tiny_corpus)
    expected, _ = hf_mean_loss(str(checkpoint), ids, BLOCK)
    got, _ = hf_mean_loss(str(tmp_path / "hf"), ids, BLOCK)
    assert abs(got - expected) / expected <= 1e-5, (got, expected)


LAYOUTS = {"tp2": ({"parallel.tp": 2}, 1), "fsdp2": ({"parallel.dp_shard": 2}, 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_under_tp_or_fsdp_equals_one_process(layout, tmp_path, tiny_corpus, checkpoint):
    """TP x 2 (each rank one of the two key/value heads and its two query heads, half of each
    gate/up row block: the fused tensors read by the rows a rank holds) or FSDP x 2 (one process
    accumulating the two halves of the batch) scores the step and the validation as one process."""
    settings, accumulate = LAYOUTS[layout]
    single = run(tmp_path / "single", tiny_corpus, checkpoint, **{"trainer.grad_accum": accumulate})
    parallel = run(tmp_path / "parallel", tiny_corpus, checkpoint, nproc=2, **settings)
    for key in ("loss", "val_loss"):
        assert [r[key] for r in parallel if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)


def test_lora_exports_merged_and_peft_refuses_in_one_line(checkpoint, tmp_path, tiny_corpus):
    """PEFT adapts transformers' fused qkv_proj as one layer, not triax's three: no PEFT adapter is
    written; the merged export loads in transformers with triax's logits."""
    from support.helpers import final_weights
    from triax.interop.hf.whole_model import load_hf_model
    from triax.models.lora import LoRAConfig, apply_lora

    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 2, "trainer.batch_size": 4,
        "optim.lr": 1e-2, "parallel.dp_replicate": 1, "model.lora.rank": 4, "model.lora.alpha": 8,
        "model.lora.targets": "[q,k,v,o,gate,up,down]"}), timeout=300)
    refused = launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "adapter"), "--format", "peft"],
                     check=False)
    assert refused.returncode == 2 and "export it with --format hf --merge" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "merged"), "--format", "hf", "--merge"])
    ours = load_hf_model(str(checkpoint), torch.device("cpu"))
    apply_lora(ours, LoRAConfig(rank=4, alpha=8, targets=["q", "k", "v", "o", "gate", "up", "down"]))
    weights = final_weights(run_dir)
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if name in weights:
                parameter.data = weights[name].clone()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.randint(0, 301, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits, plain = ours.eval()(ids), load_hf_model(str(checkpoint), torch.device("cpu"))(ids)
        torch.testing.assert_close(merged(ids).logits, ours_logits, atol=1e-5, rtol=1e-5)
    assert (ours_logits - plain).abs().max() > 1e-3  # the adapters changed the model
