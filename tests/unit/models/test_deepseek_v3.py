"""DeepSeek-V3 (model.arch=deepseek_v3): tiny random checkpoints saved by transformers compute the
same LM loss in triax (fp32, |rel| <= 1e-5), with and without the query latent, in one process and
through `triax eval`; greedy generation through the latent cache gives transformers' tokens, and the
cache holds kv_lora_rank + qk_rope_head_dim values per token and layer; a checkpoint that does not
match its config is one line; the new fields are bounded."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from support.deepseek_checkpoints import VOCAB, save_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

BLOCK = 32
# YaRN as DeepSeek-V3 is released (its mscale and mscale_all_dim 1), stretching a context of 16 four
# times: the windows of 32 positions reach past it.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {"query_latent": {}, "no_query_latent": dict(q_lora_rank=None), "yarn": dict(rope_parameters=YARN)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (save_pretrained directory, the transformers model)."""
    made = {}

    def get(variant):
        if variant not in made:
            directory = tmp_path_factory.mktemp(variant)
            made[variant] = directory, save_checkpoint(directory, **VARIANTS[variant])
        return made[variant]

    return get


def windows():
    return torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(1))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lm_loss_equals_transformers(variant, checkpoints):
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoints(variant)
    ours = load_hf_model(str(directory), torch.device("cpu"))
    assert ours.config.arch == "deepseek_v3" and (ours.config.q_lora_rank is None) == (variant == "no_query_latent")
    assert ours.config.rope_scaling == ("yarn" if variant == "yarn" else "none")
    if variant == "yarn":  # of the two rotary pairs the fast one is kept, the slow one interpolated 4 times
        from triax.models.llama import inverse_frequencies

        plain = inverse_frequencies(ours.config, 4)
        assert torch.allclose(ours.rotary.inverse, torch.stack([plain[0], plain[1] / 4]))
        assert ours.layers["0"].attn.softmax_factor == pytest.approx((0.1 * math.log(4) + 1) ** 2)
    ids = windows()
    with torch.no_grad():
        expected = reference(ids, labels=ids).loss.item()
        got = lm_loss(ours(ids), ids)
    assert abs(got - expected) / expected <= 1e-5, (got, expected)


def test_the_correction_bias_and_the_groups_matter(checkpoints):
    """The checkpoint's correction bias is read (zeroing it changes the loss), and group-limited
    routing chooses other experts than plain top-k would."""
    from triax.interop.hf.whole_model import load_hf_model
    from triax.models.deepseek_v3.model import group_limited_route

    directory, _ = checkpoints("query_latent")
    ours = load_hf_model(str(directory), torch.device("cpu"))
    ids = windows()
    mlp = ours.layers["1"].mlp
    assert mlp.expert_bias.abs().min() > 0
    with torch.no_grad():
        before = lm_loss(ours(ids), ids)
        mlp.expert_bias.zero_()
        after = lm_loss(ours(ids), ids)
    assert abs(after - before) > 1e-4
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    no_bias = torch.zeros(8)
    grouped = group_limited_route(logits, 2, True, no_bias, groups=4, topk_groups=1)[1]
    assert bool(((grouped // 2)[:, 0] == (grouped // 2)[:, 1]).all())  # both experts from one group of two
    plain = group_limited_route(logits, 2, True, no_bias, groups=1, topk_groups=1)[1]
    assert not torch.equal(grouped.sort().values, plain.sort().values)


def test_triax_eval_equals_transformers(checkpoints, tmp_path, capsys):
    from support.hf_scoring import hf_mean_loss
    from triax.commands.cli import main

    directory, _ = checkpoints("query_latent")
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(2))
    ids.numpy().astype("uint16").tofile(tmp_path / "val.bin")
    capsys.readouterr()
    assert main(["eval", str(directory), "--tokens", str(tmp_path / "val.bin"), "--json"]) == 0
    result = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])
    expected, tokens = hf_mean_loss(str(directory), ids, 64)
    assert result["tokens"] == tokens == len(ids) - 1
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_through_the_latent_cache_equals_transformers(variant, checkpoints):
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoints(variant)
    ours = load_hf_model(str(directory), torch.device("cpu"))
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt),
                                      pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 20, greedy=True), expected)
    assert torch.equal(ours.generate(prompt, 20, greedy=True, use_cache=False), expected)


def test_the_cache_holds_the_latent_only(checkpoints):
    """Per token and layer: kv_lora_rank + qk_rope_head_dim values (16 + 4 here), not the
    n_head x (qk_nope + qk_rope + v_head_dim) = 4 x 18 that full keys and values would take."""
    from triax.interop.hf.whole_model import load_hf_model
    from triax.models import KVCache

    directory, _ = checkpoints("query_latent")
    ours = load_hf_model(str(directory), torch.device("cpu"))
    cache, tokens = KVCache(), 11
    with torch.no_grad():
        ours(torch.randint(0, VOCAB, (1, tokens)), cache)
        ours(torch.randint(0, VOCAB, (1, 1)), cache)
    held = sum(t.numel() * t.element_size() for layer in cache.layers.values() for t in (layer.keys, layer.values))
    c = ours.config
    assert held / (tokens + 1) == c.n_layer * (c.kv_lora_rank + c.qk_rope_head_dim) * 4 == 3 * 20 * 4
    assert ours.latent_cache_values() == c.n_layer * 20


@pytest.mark.multiprocess
def test_a_run_from_the_checkpoint_exports_back(tmp_path, tiny_corpus, checkpoints):
    """One step at a negligible learning rate from the checkpoint (with a tokenizer beside it): the
    `--format hf` export loads in AutoModelForCausalLM and scores the corpus as the original does."""
    import shutil

    from support.forked import launch
    from support.helpers import tiny_overrides, train
    from support.hf_scoring import hf_mean_loss
    from support.llama_checkpoints import train_tokenizer

    source, _ = checkpoints("query_latent")
    directory = tmp_path / "checkpoint"
    shutil.copytree(source, directory)
    tokenizer = train_tokenizer(tiny_corpus, directory / "tokenizer.json")
    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{
        "model.init_from": str(directory), "data.block_size": BLOCK, "trainer.max_steps": 1,
        "trainer.batch_size": 4, "optim.lr": 1e-12, "optim.min_lr": 0.0, "trainer.eval_every": 1,
        "trainer.eval_batches": 0, "parallel.dp_replicate": 1, "trainer.log_every": 1}), timeout=300)
    assert json.load(open(run_dir / "model.json"))["arch"] == "deepseek_v3"
    launch(1, ["-m", "triax", "export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"])
    assert json.load(open(tmp_path / "hf" / "config.json"))["model_type"] == "deepseek_v3"
    ids = torch.tensor(tokenizer.encode(open(tiny_corpus, encoding="utf-8").read(), add_special_tokens=False).ids[-2000:])
    original, _ = hf_mean_loss(str(directory), ids, BLOCK)
    exported, _ = hf_mean_loss(str(tmp_path / "hf"), ids, BLOCK)
    assert abs(exported - original) / original <= 1e-5, (exported, original)


def _with(directory, target, config_change=None, tensors_change=None):
    """A copy of checkpoint `directory` with its config.json and tensors changed."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    config = json.loads((directory / "config.json").read_text())
    if config_change:
        config_change(config)
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(directory / "model.safetensors"))
    if tensors_change:
        tensors_change(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


HOSTILE = {
    "a rank as a string": (dict(config_change=lambda c: c.update(kv_lora_rank="16")), "kv_lora_rank='16' is a JSON string; transformers takes an integer"),
    "rotary halves": (dict(config_change=lambda c: c.update(rope_interleave=False)), "rope_interleave=False"),
    "yarn of another mscale": (dict(config_change=lambda c: c.update(rope_parameters={**YARN, "mscale": 0.707})),
                               "rope_parameters.mscale=0.707"),
    "yarn's truncate as a string": (dict(config_change=lambda c: c.update(rope_parameters={**YARN, "truncate": "no"})),
                                    "rope_parameters.truncate='no' is a JSON string; transformers takes true or false"),
    "longrope": (dict(config_change=lambda c: c.update(rope_parameters={"rope_type": "longrope", "factor": 4.0})),
                 "rope_type='longrope'"),
    "softmax routing": (dict(config_change=lambda c: c.update(scoring_func="softmax")), "scoring_func='softmax'"),
    "groups that do not divide": (dict(config_change=lambda c: c.update(n_group=3)), "router_groups=3 must divide"),
    "no correction bias": (dict(tensors_change=lambda t: t.pop("model.layers.2.mlp.gate.e_score_correction_bias")),
                           "the correction bias of layer 2"),
    "a NaN correction bias": (dict(tensors_change=lambda t: t["model.layers.1.mlp.gate.e_score_correction_bias"]
                                   .fill_(float("nan"))), "e_score_correction_bias holds values that are not finite"),
    "an expert missing": (dict(tensors_change=lambda t: t.pop("model.layers.1.mlp.experts.7.up_proj.weight")),
                          "experts.7.up_proj.weight"),
    "groups of null": (dict(config_change=lambda c: c.update(n_group=None)), "n_group=None is a JSON null; transformers takes an integer there"),
    "no group count: transformers' 8": (dict(config_change=lambda c: c.pop("n_group")), "router_groups=8 leaves"),
    "a latent of another width": (dict(config_change=lambda c: c.update(kv_lora_rank=12)), "kv_a_proj_with_mqa"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_checkpoint_that_does_not_match_is_one_line(case, checkpoints, tmp_path):
    from triax.interop.hf.files import CheckpointError
    from triax.interop.hf.whole_model import load_hf_model

    directory, _ = checkpoints("query_latent")
    change, words = HOSTILE[case]
    with pytest.raises(CheckpointError) as error:
        load_hf_model(str(_with(directory, tmp_path / "changed", **change)), torch.device("cpu"))
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("fields, words", [
    (dict(kv_lora_rank=0), "model.kv_lora_rank=0 with model.arch=deepseek_v3"),
    (dict(qk_rope_head_dim=5), "qk_rope_head_dim=5 is odd"),
    (dict(head_dim=16), "head_dim=16: a latent attention head's query/key width is"),
    (dict(n_kv_head=1), "n_kv_head=1: latent attention gives every query head"),
    (dict(router_scoring="softmax"), "router_scoring='softmax' with model.arch=deepseek_v3"),
    (dict(router_groups=3), "router_groups=3 must divide"),
    (dict(router_groups=8), "fewer than 2 experts per group"),
    (dict(router_topk_groups=1, experts_per_token=3), "experts_per_token=3 is above the experts of"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0 must be a number"),
    (dict(first_dense_layers=3), "first_dense_layers=3 must be a layer count"),
    (dict(q_lora_rank=2**21), "q_lora_rank=2097152 must be a positive integer of at most"),
    (dict(sliding_window=8), "model.sliding_window=8 with model.arch=deepseek_v3"),
    (dict(rope_scaling="yarn", rope_factor=4.0, rope_attention_factor=1.2), "model.rope_attention_factor=1.2"),
])
def test_the_fields_are_bounded(fields, words):
    from triax.errors import ConfigError
    from triax.models import GPTConfig

    base = dict(vocab_size=50, block_size=16, arch="deepseek_v3", n_layer=2, n_head=2, n_embd=16, num_experts=8,
                router_scoring="sigmoid", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, router_groups=4,
                router_topk_groups=2)
    with pytest.raises(ConfigError) as error:
        GPTConfig(**{**base, **fields})
    assert words in str(error.value), str(error.value)
    config = GPTConfig(**base)
    assert (config.head_dim, config.n_kv_head, config.v_head_dim, config.norm_topk_prob) == (8, 2, 4, True)


@pytest.mark.parametrize("fields, words", [
    (dict(num_experts=0, router_scoring="softmax", router_groups=1, router_topk_groups=1,
          shared_expert_intermediate_size=0), "without experts"),
    (dict(shared_expert_intermediate_size=24), "not a whole number of experts"),
])
def test_what_transformers_cannot_compute_is_not_exported(fields, words):
    from triax.interop.hf.export import ExportError, check_mappable
    from triax.models import GPTConfig

    base = dict(vocab_size=50, block_size=16, arch="deepseek_v3", n_layer=2, n_head=2, n_embd=16, num_experts=8,
                router_scoring="sigmoid", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, router_groups=4,
                router_topk_groups=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
    check_mappable(GPTConfig(**base))
    with pytest.raises(ExportError, match=words):
        check_mappable(GPTConfig(**{**base, **fields}))


def test_a_yarn_model_exports_to_transformers(checkpoints, tmp_path):
    """triax's own config.json of a YaRN model (no checkpoint's kept beside it) loads in transformers
    and scores the windows as the checkpoint the model was read from."""
    from triax.interop.hf.export import export_hf
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoints("yarn")
    ours = load_hf_model(str(directory), torch.device("cpu"))
    export_hf(ours.config, ours.state_dict(), str(tmp_path / "hf"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert exported.config.rope_parameters["rope_type"] == "yarn"
    ids = windows()
    with torch.no_grad():
        expected, got = reference(ids, labels=ids).loss.item(), exported(ids, labels=ids).loss.item()
    assert abs(got - expected) / expected <= 1e-5, (got, expected)
