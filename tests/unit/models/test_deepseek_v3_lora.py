"""LoRA on DeepSeek-V3 as PEFT computes it on transformers' DeepseekV3ForCausalLM: on a tiny random
checkpoint saved by transformers, PEFT's adapters read into triax give the same loss and the same
adapter gradients (fp32), with and without the query latent; a LoRA run's `--format peft` export
loads in peft.PeftModel and scores as `triax eval` scores the run, its `--format hf --merge` export
in AutoModelForCausalLM alike; a target the model lacks is one line."""

import json

import pytest
import torch
import torch.nn.functional as F

from support.deepseek_checkpoints import VOCAB, save_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'triax[test]')")

BLOCK = 32
# The layers LoRA adapts on the model, the attention's, as PEFT names them (PEFT's all-linear on it
# adapts these and, as parameters, the routed experts and the router, which triax does not adapt).
LATENT_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
VARIANTS = {"query_latent": ({}, LATENT_TARGETS),
            "no_query_latent": (dict(q_lora_rank=None), ["q_proj", *LATENT_TARGETS[2:]])}


def peft_adapter(directory, target_modules, out):
    """PEFT's adapters on the checkpoint, saved to `out`: A as PEFT draws it, B random (not zero, so
    the adapters change the loss and A's gradients are not zero); the PeftModel."""
    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    adapted.save_pretrained(str(out))
    return adapted


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("targets", ["all-linear", "named"])
def test_triax_lora_equals_peft_loss_and_gradients(variant, targets, tmp_path):
    """The same adapters (PEFT's, saved and read through model.lora.init_from's reader): the loss
    within 1e-5 (relative) and every adapter's gradient within 1e-5 of its largest value: fp32
    (epsilon 1.2e-7) sums over 128 tokens and 3 layers in another order, a few epsilons per
    operation (measured: 7e-7)."""
    from triax.interop.hf.whole_model import load_hf_model
    from triax.interop.peft.adapter import load_adapter, peft_name
    from triax.models.lora import LoRAConfig, apply_lora

    fields, target_modules = VARIANTS[variant]
    save_checkpoint(tmp_path / "base", **fields)
    reference = peft_adapter(tmp_path / "base", target_modules, tmp_path / "adapter")
    ours = load_hf_model(str(tmp_path / "base"), torch.device("cpu"))
    lora = LoRAConfig(rank=4, alpha=8, targets=target_modules if targets == "named" else ["all-linear"])
    adapted = apply_lora(ours, lora)
    assert len(adapted) == 3 * len(target_modules)  # every layer has each of them
    assert load_adapter(ours, str(tmp_path / "adapter"), lora, whole=True) > 0
    ids = torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(1))
    ours_loss = lm_loss(ours(ids), ids)
    peft_loss = reference(ids, labels=ids).loss
    assert abs(ours_loss.item() - peft_loss.item()) / peft_loss.item() <= 1e-5
    ours_loss.backward()
    peft_loss.backward()
    peft_parameters = dict(reference.named_parameters())
    compared = 0
    for name, parameter in ours.named_parameters():
        if not parameter.requires_grad:
            continue
        theirs = peft_parameters[peft_name(name, "deepseek_v3").replace(".weight", ".default.weight")].grad
        scale = theirs.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(parameter.grad, theirs, rtol=0, atol=1e-5 * scale)
        compared += 1
    assert compared == 2 * len(adapted)


@pytest.mark.parametrize("targets, words", [
    (["k"], "'k' (k_proj), which LoRA on a model.arch=deepseek_v3 model does not adapt; choose among q_a (q_a_proj), "
            "q_b (q_b_proj), kv_a (kv_a_proj_with_mqa), kv_b (kv_b_proj), o (o_proj), or all-linear"),
    (["q_proj"], "'q' (q_proj), which LoRA on a model.arch=deepseek_v3 model does not adapt"),
])
def test_a_target_the_model_lacks_is_one_line(targets, words):
    from triax.errors import ConfigError
    from triax.models import GPTConfig, build_model
    from triax.models.lora import LoRAConfig, apply_lora

    with torch.device("meta"):
        model = build_model(GPTConfig.from_preset("deepseek-v3-debug", vocab_size=64, block_size=16))
    with pytest.raises(ConfigError) as caught:
        apply_lora(model, LoRAConfig(rank=4, targets=targets))
    assert "\n" not in str(caught.value) and words in str(caught.value), str(caught.value)


@pytest.mark.parametrize("target, words", [("k", "'k' (k_proj)"), ("gate_proj", "'gate' (gate_proj)")])
def test_triax_train_refuses_such_a_target_in_one_line(target, words, sandbox):
    """`triax train` refuses it before anything of the run is written (no run directory left)."""
    sandbox.refused(["train", "model=deepseek-v3-debug", "model.lora.rank=4", f"model.lora.targets=[{target}]",
                     "trainer.max_steps=1", f"trainer.run_dir={sandbox.work / 'run'}"], words,
                    "model.arch=deepseek_v3 model does not adapt; choose among q_a (q_a_proj)")


def test_the_mlp_is_not_a_target():
    """PEFT takes gate_proj, up_proj and down_proj on DeepseekV3ForCausalLM to mean the routed
    experts' fused weights (target_parameters, which triax does not adapt), not the dense and shared
    MLPs' layers: those targets are refused in one line, and all-linear adapts the attention alone."""
    from triax.errors import ConfigError
    from triax.models import GPTConfig, build_model
    from triax.models.lora import LoRAConfig, apply_lora

    config = GPTConfig.from_preset("deepseek-v3-debug", vocab_size=64, block_size=16)
    with torch.device("meta"):
        for target in ("gate", "up_proj", "down"):
            with pytest.raises(ConfigError, match="which LoRA on a model.arch=deepseek_v3 model does not adapt"):
                apply_lora(build_model(config), LoRAConfig(rank=4, targets=[target]))
        adapted = apply_lora(build_model(config), LoRAConfig(rank=4, targets=["all-linear"]))
    assert {name.split(".", 2)[2] for name in adapted} == {"attn.q_a_proj", "attn.q_b_proj",
                                                          "attn.kv_a_proj_with_mqa", "attn.kv_b_proj", "attn.out_proj"}


def test_peft_reads_gate_proj_as_the_experts():
    """Why the MLPs are refused: PEFT rewrites a gate_proj/up_proj/down_proj target on this model into
    the routed experts' parameters."""
    from support.deepseek_checkpoints import hf_model

    mlp = ["gate_proj", "up_proj", "down_proj"]
    adapted = peft.get_peft_model(hf_model(), peft.LoraConfig(r=4, target_modules=["o_proj", *mlp]))
    config = adapted.peft_config["default"]
    assert set(config.target_modules) == {"o_proj"} and "gate_up_proj" in set(config.target_parameters)


@pytest.mark.multiprocess
def test_a_lora_run_exports_to_peft_and_merged_scoring_as_triax_eval(tmp_path, tiny_corpus):
    """3 steps of LoRA on the attention from the checkpoint: `--format peft` loads in
    peft.PeftModel over transformers' DeepseekV3ForCausalLM, and `--format hf --merge` in
    AutoModelForCausalLM, each scoring a token file as `triax eval` scores the run (fp32, 1e-5)."""
    from support.forked import launch
    from support.helpers import tiny_overrides, train
    from support.hf_scoring import hf_mean_loss, model_mean_loss
    from support.llama_checkpoints import train_tokenizer

    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(checkpoint)
    train_tokenizer(tiny_corpus, checkpoint / "tokenizer.json")
    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 3, "trainer.batch_size": 4,
        "optim.lr": 1e-2, "parallel.dp_replicate": 1, "model.lora.rank": 4, "model.lora.alpha": 8,
        "model.lora.targets": "[all-linear]"}), timeout=300)
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "adapter"), "--format", "peft"])
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "merged"), "--format", "hf", "--merge"])
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_modules"] == LATENT_TARGETS and saved["r"] == 4 and saved["lora_alpha"] == 8
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(2))
    ids.numpy().astype("uint16").tofile(tmp_path / "val.bin")
    scored = json.loads(launch(1, ["-m", "triax", "eval", str(run_dir), "--tokens", str(tmp_path / "val.bin"),
                                   "--block-size", str(BLOCK), "--json"]).stdout.strip().splitlines()[-1])
    base = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    original, tokens = model_mean_loss(base, ids, BLOCK)
    adapted, _ = model_mean_loss(peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval(), ids, BLOCK)
    merged, _ = hf_mean_loss(str(tmp_path / "merged"), ids, BLOCK)
    assert scored["tokens"] == tokens
    assert abs(adapted - scored["loss"]) / scored["loss"] <= 1e-5, (adapted, scored)
    assert abs(merged - scored["loss"]) / scored["loss"] <= 1e-5, (merged, scored)
    assert abs(adapted - original) > 1e-4  # the adapters changed the model


@pytest.mark.multiprocess
def test_lora_under_tp_equals_one_process(tmp_path, tiny_corpus):
    """3 steps of LoRA on every attention layer of a latent-attention model from one seed: under TP
    x 2 the latents' adapters are replicated (their gradients summed over the ranks by DTensor, as
    the latents' own), q_b's and kv_b's split with their heads, o's by its input; the losses and the
    adapters equal one process's."""
    from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.arch": "deepseek_v3", "model.kv_lora_rank": 16, "model.q_lora_rank": 24,
            "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 4, "model.v_head_dim": 6, "model.n_head": 4,
            "model.lora.rank": 4, "model.lora.alpha": 8, "model.lora.targets": "[all-linear]", "optim.lr": 1e-2,
            "trainer.max_steps": 3, "trainer.batch_size": 4, "trainer.log_every": 1, "trainer.eval_every": 3,
            "trainer.eval_batches": 0, "parallel.dp_replicate": 1, **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    single = run(tmp_path / "single", 1)
    parallel = run(tmp_path / "tp2", 2, **{"parallel.tp": 2})
    for key in ("loss", "val_loss", "grad_norm"):
        assert [r[key] for r in parallel if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    one = final_weights(tmp_path / "single")
    assert sorted(one) == sorted(final_weights(tmp_path / "tp2"))
    assert len(one) == 2 * 5 * 2  # 2 blocks, 5 adapted layers, A and B
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    assert_adam_close(final_weights(tmp_path / "tp2"), one, learning_rates)


@pytest.mark.multiprocess
def test_lora_under_fsdp_and_ep_equals_one_process(tmp_path, tiny_corpus):
    """3 LoRA steps from the checkpoint under FSDP x 2 with EP x 2 (each rank holding half the frozen
    experts, the adapters sharded with their blocks) equal one process accumulating the two halves."""
    from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train
    from support.llama_checkpoints import train_tokenizer

    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(checkpoint)
    train_tokenizer(tiny_corpus, checkpoint / "tokenizer.json")

    def run(run_dir, nproc, **settings):
        train(tiny_overrides(run_dir, tiny_corpus, **{
            "model.init_from": str(checkpoint), "data.block_size": BLOCK, "trainer.max_steps": 3,
            "trainer.batch_size": 4, "trainer.log_every": 1, "trainer.eval_every": 3, "trainer.eval_batches": 0,
            "optim.lr": 1e-2, "parallel.dp_replicate": 1, "model.lora.rank": 4, "model.lora.alpha": 8,
            "model.lora.targets": "[q_a,kv_b,o]", **settings}), nproc=nproc, timeout=300)
        return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

    single = run(tmp_path / "single", 1, **{"trainer.grad_accum": 2})
    sharded = run(tmp_path / "ep2", 2, **{"parallel.dp_shard": 2, "parallel.ep": 2})
    for key in ("loss", "val_loss"):
        assert [r[key] for r in sharded if key in r] == pytest.approx([r[key] for r in single if key in r], rel=1e-5)
    one = final_weights(tmp_path / "single")
    # 3 blocks, 3 adapted layers, A and B; besides them only the routed layers' correction biases
    # (buffers the balancing update may move)
    assert len([name for name in one if ".lora_" in name]) == 3 * 3 * 2
    assert sorted(name for name in one if ".lora_" not in name) == ["layers.1.mlp.expert_bias",
                                                                    "layers.2.mlp.expert_bias"]
    learning_rates = [run_config(tmp_path / "single")["optim"]["lr"]] * 3
    assert_adam_close(final_weights(tmp_path / "ep2"), one, learning_rates)
