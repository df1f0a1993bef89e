"""gpt-oss as a user runs it: a run started from the tiny transformers checkpoint (one step at a
negligible learning rate) scores under `triax eval` as transformers scores the checkpoint, and its
`--format hf` export loads in AutoModelForCausalLM and scores alike; fine-tuning under FSDP x 2 and
EP x 2 equals one process taking the two halves as accumulated micro-batches."""

import json

import pytest
import torch

from support.forked import launch
from support.gpt_oss_checkpoints import save_checkpoint
from support.helpers import tiny_overrides, train
from support.hf_scoring import tokenizer_validation_ids

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")
pytestmark = pytest.mark.multiprocess

BLOCK = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_corpus):
    directory = tmp_path_factory.mktemp("gpt_oss")
    save_checkpoint(directory, tiny_corpus)
    return directory


def test_a_run_from_the_checkpoint_evaluates_and_exports_as_transformers_scores(checkpoint, tmp_path, tiny_corpus):
    from support.hf_scoring import hf_mean_loss

    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 1,
        "trainer.batch_size": 4, "optim.lr": 1e-12, "optim.min_lr": 0.0, "trainer.eval_every": 1,
        "trainer.eval_batches": 0, "parallel.dp_replicate": 1, "trainer.log_every": 1}), timeout=300)
    model = json.load(open(run_dir / "model.json"))
    assert model["arch"] == "gpt_oss" and model["sliding_window"] == 4 and model["attention_sinks"]
    # `triax eval` of the run scores its validation split as its trainer did
    record = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
    scored = json.loads(launch(1, ["-m", "triax", "eval", str(run_dir), "--json"]).stdout.strip().splitlines()[-1])
    assert scored["loss"] == pytest.approx(record["val_loss"], rel=1e-5)
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"])
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["model_type"] == "gpt_oss" and config["sliding_window"] == 4
    ids = tokenizer_validation_ids(checkpoint, tiny_corpus)
    original, _ = hf_mean_loss(str(checkpoint), ids, BLOCK)
    exported, _ = hf_mean_loss(str(tmp_path / "hf"), ids, BLOCK)
    assert abs(exported - original) / original <= 1e-5, (exported, original)


LAYOUTS = {"fsdp2": ({"parallel.dp_shard": 2}, 2), "ep2": ({"parallel.dp_shard": 2, "parallel.ep": 2}, 2),
           "pp2": ({"parallel.pp": 2, "model.router_aux_loss_coef": 0.0}, 1)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fine_tuning_under_fsdp_ep_or_pp_equals_one_process(layout, tmp_path, tiny_corpus, checkpoint):
    """3 steps: FSDP x 2 (the experts and their biases sharded along the expert dimension) or EP x 2
    (each rank holding two of the four experts, tokens exchanged all-to-all), with the
    load-balancing loss on, equal one process accumulating the two halves; PP x 2 (the three layers
    over two stages, each layer keeping its own window by its number; the router's loss off: the
    pipeline's loss does not see it) equals one process."""
    from support.helpers import assert_adam_close, final_weights, run_config

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 3,
            "trainer.batch_size": 4, "trainer.log_every": 1, "trainer.eval_every": 3, "trainer.eval_batches": 0,
            "parallel.dp_replicate": 1, "model.router_aux_loss_coef": 0.02, **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    settings, accumulate = LAYOUTS[layout]
    loss_settings = {key: value for key, value in settings.items() if key.startswith("model.")}
    single = run(tmp_path / "single", 1, **{"trainer.grad_accum": accumulate, **loss_settings})
    sharded = run(tmp_path / "sharded", 2, **settings)
    for key in ("loss", "val_loss"):
        assert [r[key] for r in sharded if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    assert_adam_close(final_weights(tmp_path / "sharded"), final_weights(tmp_path / "single"), learning_rates)


def test_lora_on_attention_exports_to_peft(tmp_path, tiny_corpus, checkpoint):
    """LoRA on q/k/v/o (the experts, sinks and router frozen): `--format peft` loads in
    peft.PeftModel over transformers' GptOssForCausalLM with triax's logits (fp32, 1e-5)."""
    peft = pytest.importorskip("peft")
    from support.helpers import final_weights
    from triax.interop.hf.whole_model import load_hf_model
    from triax.models.lora import LoRAConfig, apply_lora

    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 3, "trainer.batch_size": 4,
        "optim.lr": 1e-2, "parallel.dp_replicate": 1, "model.lora.rank": 4, "model.lora.alpha": 8,
        "model.lora.targets": "[q,k,v,o]"}), timeout=300)
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "adapter"), "--format", "peft"])
    weights = final_weights(run_dir)
    ours = load_hf_model(str(checkpoint), torch.device("cpu"))
    apply_lora(ours, LoRAConfig(rank=4, alpha=8, targets=["q", "k", "v", "o"]))
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if name in weights:
                parameter.data = weights[name].clone()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    reference = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, 301, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        triax_logits, peft_logits = ours(ids), reference(ids).logits
        plain = load_hf_model(str(checkpoint), torch.device("cpu"))(ids)
    torch.testing.assert_close(triax_logits, peft_logits, atol=1e-5, rtol=1e-5)
    assert (triax_logits - plain).abs().max() > 1e-3  # the adapters changed the model
