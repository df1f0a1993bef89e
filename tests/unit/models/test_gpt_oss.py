"""gpt-oss: a tiny random checkpoint saved by transformers (fp32; sinks, a 4-token window on every
other layer, YaRN, clamped experts with biases) computes transformers' LM loss in triax (|rel| <=
1e-5, the window shorter than the scored windows and mattering), in one process and through
`triax eval`; greedy generation through the cache is transformers' token for token; MXFP4 experts
read equal to transformers' own dequantization; the export loads in transformers and scores alike."""

import json

import pytest
import torch
import torch.nn.functional as F

from support.gpt_oss_checkpoints import WINDOW, hf_model, save_checkpoint, save_mxfp4_checkpoint
from support.llama_checkpoints import VOCAB

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

BLOCK = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_corpus):
    """(save_pretrained directory with tokenizer.json, the transformers model)."""
    directory = tmp_path_factory.mktemp("gpt_oss")
    return directory, save_checkpoint(directory, tiny_corpus)


def windows():
    return torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(1))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).item()


def test_lm_loss_equals_transformers_and_the_window_matters(checkpoint):
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoint
    ours = load_hf_model(str(directory), torch.device("cpu"))
    assert ours.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert ours.config.sliding_window == WINDOW < BLOCK
    ids = windows()
    with torch.no_grad():
        expected = reference(ids, labels=ids).loss.item()
        got = lm_loss(ours(ids), ids)
        unwindowed = hf_model(sliding_window=BLOCK)(ids, labels=ids).loss.item()
    assert abs(got - expected) / expected <= 1e-5, (got, expected)
    assert abs(unwindowed - expected) / expected > 1e-4  # without the window the same weights score otherwise


def test_triax_eval_of_the_checkpoint_scores_as_transformers(checkpoint, tmp_path, capsys):
    from support.helpers import eval_token_stream
    from support.hf_scoring import model_mean_loss

    directory, reference = checkpoint
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(2))
    result = eval_token_stream(directory, ids, BLOCK, tmp_path, capsys)
    expected, tokens = model_mean_loss(reference, ids, BLOCK)
    assert result["tokens"] == tokens == len(ids) - 1
    assert abs(result["loss"] - expected) / expected <= 1e-5, (result["loss"], expected)


def test_greedy_generation_through_the_cache_equals_transformers(checkpoint):
    """20 tokens after a 6-token prompt: the sliding layers' queries see their last 4 keys of the
    cache, the full layers all of them."""
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoint
    ours = load_hf_model(str(directory), torch.device("cpu"))
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20,
                                      pad_token_id=0, attention_mask=torch.ones_like(prompt))
    cached = ours.generate(prompt, 20, greedy=True)
    uncached = ours.generate(prompt, 20, greedy=True, use_cache=False)
    assert cached.tolist() == expected.tolist()
    assert uncached.tolist() == expected.tolist()
    # The sliding layers' caches hold only what a later query sees: the last WINDOW - 1 positions.
    from triax.models import KVCache

    cache = KVCache()
    with torch.no_grad():
        ours(prompt, cache)
        ours(cached[:, 6:7], cache)
    assert cache.length == 7 and [cache.layers[str(layer)].keys.size(2) for layer in range(3)] == [WINDOW - 1, 7,
                                                                                                    WINDOW - 1]


def test_mxfp4_experts_read_as_transformers_dequantizes_them(tmp_path):
    """A checkpoint whose experts are MXFP4 blocks and scales (random codes and exponents): each
    triax expert tensor equals transformers' dequantization, and the model scores as transformers'
    model holding those dequantized weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from triax.interop.hf.whole_model import load_hf_model

    save_checkpoint(tmp_path / "plain", intermediate_size=32)
    tensors = save_mxfp4_checkpoint(tmp_path / "mxfp4", tmp_path / "plain")
    ours = load_hf_model(str(tmp_path / "mxfp4"), torch.device("cpu"))
    reference = hf_model(intermediate_size=32)
    with torch.no_grad():
        for layer in range(3):
            stored = f"model.layers.{layer}.mlp.experts"
            experts = reference.model.layers[layer].mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                dequantized = convert_moe_packed_tensors(tensors[f"{stored}.{name}_blocks"],
                                                         tensors[f"{stored}.{name}_scales"], dtype=torch.float32)
                getattr(experts, name).copy_(dequantized)  # [experts, inputs, outputs], as transformers holds it
            ours_experts = ours.layers[str(layer)].mlp.experts
            assert torch.equal(ours_experts.gate_proj, experts.gate_up_proj[:, :, 0::2].transpose(1, 2))
            assert torch.equal(ours_experts.up_proj, experts.gate_up_proj[:, :, 1::2].transpose(1, 2))
            assert torch.equal(ours_experts.down_proj, experts.down_proj.transpose(1, 2))
        ids = windows()
        expected = reference(ids, labels=ids).loss.item()
        got = lm_loss(ours(ids), ids)
    assert abs(got - expected) / expected <= 1e-5, (got, expected)
    # A run started from it exports the dequantized weights: its config.json without the quantization
    from triax.interop.hf.export import drop_in_files, hf_config

    written, _ = drop_in_files(ours.config, hf_config(ours.config), str(tmp_path / "mxfp4"))
    assert "quantization_config" not in written and written["swiglu_limit"] == 0.5


def test_the_export_loads_in_transformers_and_scores_alike(checkpoint, tmp_path):
    from triax.interop.hf.export import export_hf
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoint
    ours = load_hf_model(str(directory), torch.device("cpu"))
    export_hf(ours.config, ours.state_dict(), str(tmp_path / "hf"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    ids = windows()
    with torch.no_grad():
        assert exported(ids, labels=ids).loss.item() == pytest.approx(reference(ids, labels=ids).loss.item(), rel=1e-5)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name

    from triax.interop.hf.export import ExportError
    from triax.models import GPTConfig

    without = GPTConfig(**{**vars(ours.config), "attention_sinks": False})
    with pytest.raises(ExportError, match="attention_sinks=false has no equivalent"):
        export_hf(without, ours.state_dict(), str(tmp_path / "refused"))


def copy_checkpoint(source, target, change_tensors=None, change_config=None):
    """A copy of checkpoint `source`, its tensors and config.json changed."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    if change_config is not None:
        change_config(config)
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "model.safetensors"))
    if change_tensors is not None:
        change_tensors(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})


EXPERTS = "model.layers.1.mlp.experts"


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value(tensors[name]))


HOSTILE_MXFP4 = {
    "scales missing": (lambda t: t.pop(f"{EXPERTS}.down_proj_scales"), "nor model.layers.1.mlp.experts.down_proj_blocks"),
    "blocks stored as float": (_set(f"{EXPERTS}.gate_up_proj_blocks", lambda b: b.float()), "is F32"),
    "blocks of the wrong width": (_set(f"{EXPERTS}.gate_up_proj_blocks", lambda b: b[..., :8].contiguous()),
                                  "MXFP4 stores uint8 [experts, rows, groups, 16]"),
    "scales that do not match the blocks": (_set(f"{EXPERTS}.down_proj_scales", lambda s: s[:, :-1].contiguous()),
                                            "down_proj_scales U8"),
    "too few groups for the width": (lambda t: [t.__setitem__(f"{EXPERTS}.down_proj_{kind}", t[f"{EXPERTS}.down_proj_"
                                                                                               f"{kind}"][:, :, :0])
                                                for kind in ("blocks", "scales")], "down_proj"),
    "an exponent that overflows": (_set(f"{EXPERTS}.gate_up_proj_scales", lambda s: s.fill_(255)),
                                   "not finite"),
    "a bias missing": (lambda t: t.pop(f"{EXPERTS}.gate_up_proj_bias"), "no tensor 'model.layers.1.mlp.experts"
                                                                        ".gate_up_proj_bias'"),
}


@pytest.mark.parametrize("case", list(HOSTILE_MXFP4))
def test_a_damaged_mxfp4_checkpoint_is_one_line(case, tmp_path):
    from triax.interop.hf.files import CheckpointError
    from triax.interop.hf.whole_model import load_hf_model

    save_checkpoint(tmp_path / "plain", intermediate_size=32)
    save_mxfp4_checkpoint(tmp_path / "mxfp4", tmp_path / "plain")
    change, words = HOSTILE_MXFP4[case]
    copy_checkpoint(tmp_path / "mxfp4", tmp_path / "damaged", change)
    with pytest.raises(CheckpointError) as error:
        load_hf_model(str(tmp_path / "damaged"), torch.device("cpu"))
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


HOSTILE_CONFIGS = {
    "a clamp given as a string": (lambda c: c.__setitem__("swiglu_limit", "7"), "swiglu_limit='7' is a JSON string; transformers takes a finite number"),
    "layer types of another length": (lambda c: c.__setitem__("layer_types", ["full_attention"]),
                                      "layer_types=['full_attention'] must name"),
    "an unknown layer type": (lambda c: c.__setitem__("layer_types", ["local"] * 3), "sliding_attention or full"),
    "another quantization": (lambda c: c.__setitem__("quantization_config", {"quant_method": "fp8"}), "'fp8'"),
    "a rope type triax lacks": (lambda c: c["rope_parameters"].__setitem__("rope_type", "longrope"), "longrope"),
    "a yarn ramp upside down": (lambda c: c["rope_parameters"].__setitem__("beta_slow", 64.0), "rope_beta_slow=64.0"),
    "no experts": (lambda c: c.__setitem__("num_local_experts", 0), "num_experts=0 must be a positive integer"),
    "a negative window": (lambda c: c.__setitem__("sliding_window", -4), "sliding_window=-4"),
}


@pytest.mark.parametrize("case", list(HOSTILE_CONFIGS))
def test_a_config_triax_cannot_honour_is_one_line(case, checkpoint, tmp_path):
    from triax.interop.hf.files import CheckpointError
    from triax.interop.hf.whole_model import load_hf_model

    directory, _ = checkpoint
    change, words = HOSTILE_CONFIGS[case]
    copy_checkpoint(directory, tmp_path / "damaged", change_config=change)
    with pytest.raises(CheckpointError) as error:
        load_hf_model(str(tmp_path / "damaged"), torch.device("cpu"))
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("fields, words", [
    (dict(experts_per_token=5), "experts_per_token=5 must be between 1 and model.num_experts=4"),
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(swiglu_limit=-1.0), "swiglu_limit=-1.0 must be a positive number"),
    (dict(rope_scaling="llama3"), "rope_scaling='llama3' with model.arch=gpt_oss"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window is unset"),
    (dict(router_scoring="sigmoid"), "router_scoring='sigmoid' with model.arch=gpt_oss"),
])
def test_fields_are_bounded(fields, words):
    from triax.errors import ConfigError
    from triax.models import GPTConfig

    base = dict(vocab_size=50, block_size=16, arch="gpt_oss", n_layer=2, n_head=2, n_embd=16, num_experts=4)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("[", r"\[")):
        GPTConfig(**{**base, **fields})


def test_the_published_shapes_count_as_published():
    """gpt-oss-20b: 20.9B parameters, 3.6B active; gpt-oss-120b: 116.8B, 5.1B active (OpenAI's
    model card, which counts the active ones without the embedding table: 201,088 x 2,880)."""
    from triax.models import GPTConfig, PRESETS, build_model

    for name, total, active in (("gpt-oss-20b", 20.9, 3.6), ("gpt-oss-120b", 116.8, 5.1)):
        config = GPTConfig.from_preset(name, vocab_size=PRESETS[name]["vocab_size"], block_size=4096)
        with torch.device("meta"):
            model = build_model(config)
        assert round(model.num_params() / 1e9, 1) == total
        assert round((model.active_params() - model.tok_emb.weight.numel()) / 1e9, 1) == active
        assert config.layer_types[:2] == ["sliding_attention", "full_attention"] and config.sliding_window == 128


def test_yarn_tables_equal_transformers():
    """The inverse frequencies and the cos/sin gain of the released rope_parameters."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from triax.models import GPTConfig
    from triax.models.gpt_oss.model import yarn_frequencies

    reference = transformers.GptOssConfig()  # the released defaults: YaRN x32 over 4,096 tokens
    expected, gain = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    ours = GPTConfig.from_preset("gpt-oss-20b", vocab_size=201088, block_size=131072)
    inverse, our_gain = yarn_frequencies(ours)
    assert torch.allclose(inverse, expected, rtol=1e-6, atol=0) and our_gain == pytest.approx(gain, rel=1e-12)


def test_packed_examples_score_as_each_alone():
    """Two examples packed in one row (data.packing): each sees only itself, through the sinks and
    within the window, at positions from 0: its logits are those of the example alone."""
    from triax.models import GPTConfig, build_model

    torch.manual_seed(0)
    model = build_model(GPTConfig.from_preset("gpt-oss-debug", vocab_size=64, block_size=32)).eval()
    first, second = torch.randint(0, 64, (1, 20)), torch.randint(0, 64, (1, 12))
    documents = torch.tensor([[0] * 20 + [1] * 12])
    with torch.no_grad():
        packed = model(torch.cat((first, second), dim=1), documents=documents)
        torch.testing.assert_close(packed[:, :20], model(first), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, 20:], model(second), rtol=1e-5, atol=1e-5)


def test_plan_counts_the_published_shapes_and_searches_expert_parallel_layouts():
    """`triax plan --model gpt-oss-20b`: every parameter counted (biases and sinks included), the
    active ones for the FLOPs, and the expert-parallel layouts searched over the 32 experts."""
    from triax.models import GPTConfig, PRESETS, build_model
    from triax.parallel.plan import ModelShape, candidate_layouts

    config = GPTConfig.from_preset("gpt-oss-20b", vocab_size=PRESETS["gpt-oss-20b"]["vocab_size"], block_size=4096)
    shape = ModelShape.from_config(config)
    with torch.device("meta"):
        model = build_model(config)
    assert shape.num_params() == model.num_params() and shape.active_params() == model.active_params()
    layouts = candidate_layouts(8, shape)
    assert {layout.ep for layout in layouts} == {1, 2, 4, 8}
    assert not any(layout.tp > 1 or layout.cp > 1 for layout in layouts)  # refused for experts
