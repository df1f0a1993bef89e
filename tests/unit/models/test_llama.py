"""The llama family (model.arch=llama | qwen2 | mistral) against transformers' own models, in one
process: the same logits from the same weights (read from a save_pretrained directory, written
back by `--format hf`), the key/value cache with grouped heads, greedy generation token for token,
and one line for every config field triax cannot honour."""

import json

import pytest
import torch

from support.llama_checkpoints import LLAMA3_ROPE, VOCAB, hf_model, save_checkpoint
from triax.errors import ConfigError
from triax.interop.hf.whole_model import load_hf_model
from triax.models import GPTConfig, KVCache, Llama, build_model
from triax.interop.hf import directory as hf
from triax.parallel.mesh import Layout, validate_layout
from triax.interop.hf.export import export_hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

# fp32 throughout; the two implementations differ only in summation order (a few units of
# round-off of logits of size ~1), so 1e-5 separates that from any real difference, which moves
# logits by about the size of the weights' perturbation (0.05).
TOLERANCE = dict(atol=1e-5, rtol=1e-5)

CHECKPOINTS = {
    # 4 query heads on 2 key/value heads, Llama 3.1's rope scaling, a rope base of its own
    "llama": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=5000.0)),
    "qwen2": ("qwen2", {}),  # biases on q/k/v
    "mistral": ("mistral", dict(sliding_window=None)),
    "llama-tied-biased": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                        num_key_value_heads=1, head_dim=16)),  # multi-query, heads wider than n_embd/n_head
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
}


def ids(batch=3, seq=40, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_transformers_weights_give_transformers_logits(name, tmp_path):
    model_type, options = CHECKPOINTS[name]
    reference = save_checkpoint(tmp_path, model_type, **options)
    ours = load_hf_model(str(tmp_path), torch.device("cpu"))
    assert isinstance(ours, Llama) and ours.config.arch == model_type
    with torch.no_grad():
        torch.testing.assert_close(ours(ids()), reference(ids()).logits, **TOLERANCE)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_export_is_loaded_by_auto_model_with_the_same_logits(name, tmp_path):
    """triax's model (its own random weights) -> --format hf -> AutoModelForCausalLM: the model_type
    of the architecture, the same logits, and the config read back gives the same triax config."""
    model_type, options = CHECKPOINTS[name]
    save_checkpoint(tmp_path / "original", model_type, **options)
    config = GPTConfig(**hf.architecture(str(tmp_path / "original")))
    torch.manual_seed(3)
    model = build_model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    model.eval()
    export_hf(config, model.state_dict(), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == model_type
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(theirs).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "mistral": "MistralForCausalLM"}[model_type]
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids()).logits, model(ids()), **TOLERANCE)
    assert hf.architecture(str(tmp_path / "out")) == hf.architecture(str(tmp_path / "original"))


def test_a_sharded_checkpoint_reads_the_same(tmp_path):
    # save_pretrained cuts the weights into files listed by model.safetensors.index.json.
    reference = hf_model("llama")
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    ours = load_hf_model(str(tmp_path), torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids()), reference(ids()).logits, **TOLERANCE)


def tiny_llama(**options):
    torch.manual_seed(0)
    config = GPTConfig(**{**dict(vocab_size=VOCAB, block_size=24, arch="llama", n_layer=2, n_head=4, n_kv_head=2,
                                 n_embd=32, rope_scaling="llama3", rope_original_context=8), **options})
    model = build_model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cached_positions_give_the_full_forward_logits(arch):
    # Fed in pieces through the cache (keys and values of 2 heads for 4 query heads), the rotary
    # positions continue after the cached ones: the logits of feeding the whole sequence at once.
    model = tiny_llama(arch=arch)
    sequence = ids(seq=24)
    with torch.no_grad():
        whole = model(sequence)
        cache, pieces, start = KVCache(), [], 0
        for size in (7, 1, 1, 3, 12):
            pieces.append(model(sequence[:, start:start + size], cache))
            start += size
        assert cache.length == 24 and cache.layers["0"].keys.shape[1] == 2  # grouped: 2 key/value heads kept
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, **TOLERANCE)


def test_generation_with_the_cache_equals_generation_without():
    model = tiny_llama()
    prompt = ids(batch=2, seq=5)
    for kwargs in ({"greedy": True}, {"temperature": 0.9, "top_k": 5}):
        runs = [model.generate(prompt, 30, generator=torch.Generator().manual_seed(3), use_cache=use_cache,
                               **kwargs) for use_cache in (True, False)]  # 35 tokens: the window slides past 24
        assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_generation_equals_transformers_token_for_token(name, tmp_path):
    model_type, options = CHECKPOINTS[name]
    reference = save_checkpoint(tmp_path, model_type, **options)
    ours = load_hf_model(str(tmp_path), torch.device("cpu"))
    prompt = ids(batch=2, seq=6, seed=7)
    theirs = reference.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 40, greedy=True), theirs)


def test_layout_independent_initial_weights_differ_per_name():
    # The llama family uses the same layout-independent rule as the GPT: (seed, name) decides.
    config = GPTConfig(vocab_size=VOCAB, block_size=8, arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    first, again = build_model(config, seed=1).state_dict(), build_model(config, seed=1).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["layers.0.mlp.gate_proj.weight"], first["layers.1.mlp.gate_proj.weight"])
    assert torch.equal(first["layers.0.ln_1.weight"], torch.ones(32))
    with torch.device("meta"):
        stage = build_model(config, layers=[1], embeddings=False)
    stage.to_empty(device="cpu")
    stage.init_weights(seed=1)
    assert torch.equal(stage.state_dict()["layers.1.attn.k_proj.weight"], first["layers.1.attn.k_proj.weight"])


# ---- what triax refuses, in one line -----------------------------------------------------------

@pytest.mark.parametrize("model_type,changes,words", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope_type='yarn'"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("llama", {"attention_bias": True, "mlp_bias": False}, "attention_bias=True with mlp_bias=False"),
    ("llama", {"num_key_value_heads": 3}, "n_kv_head=3 does not divide"),
    ("llama", {"model_type": "gemma"}, "model_type 'gemma'"),
    ("qwen2", {"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_config_fields_triax_cannot_honour_are_one_line(tmp_path, model_type, changes, words):
    save_checkpoint(tmp_path, model_type)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.CheckpointError) as error:
        hf.architecture(str(tmp_path))
    message = str(error.value)
    assert words in message and len(message.splitlines()) == 1 and "config.json" in message, message


@pytest.mark.parametrize("model_type,options,context", [
    ("mistral", dict(sliding_window=16), 16),  # the window caps the context: within it, nothing slides
    ("mistral", dict(sliding_window=None), 64),
    ("qwen2", dict(sliding_window=16, use_sliding_window=False), 64),  # Qwen2 keeps the field unused
    ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1), 16),
])
def test_a_sliding_window_is_honoured_by_the_context(tmp_path, model_type, options, context):
    reference = save_checkpoint(tmp_path, model_type, **options)
    assert hf.architecture(str(tmp_path))["block_size"] == context
    ours = load_hf_model(str(tmp_path), torch.device("cpu"))
    with torch.no_grad():  # within the context, the window changes nothing: transformers' logits
        torch.testing.assert_close(ours(ids(seq=context)), reference(ids(seq=context)).logits, **TOLERANCE)


def test_a_checkpoint_whose_tensors_do_not_fit_its_config_is_one_line(tmp_path):
    save_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=48)))
    with pytest.raises(hf.CheckpointError, match="gate_proj.weight has shape \\[64, 32\\]"):
        load_hf_model(str(tmp_path), torch.device("cpu"))


@pytest.mark.parametrize("fields,words", [
    (dict(n_kv_head=3), "n_kv_head=3 does not divide model.n_head=4"),
    (dict(rope_scaling="yarn"), "rope_scaling='yarn' with model.arch=llama: choose one of none, linear, llama3"),
    (dict(arch="qwen2", bias=True), "transformers' qwen2 has no such option"),
    (dict(arch="llama", gelu="exact"), "model.gelu='exact' applies to model.arch=gpt2"),
    (dict(arch="gpt2", n_kv_head=2), "model.arch=gpt2 has one key/value head per query head"),
    (dict(arch="gpt2", rope_theta=500000.0), "model.rope_theta=500000.0 applies to rotary positions"),
    (dict(arch="falcon"), "model.arch='falcon' is unknown"),
])
def test_model_keys_are_checked(fields, words):
    base = dict(vocab_size=11, block_size=8, arch="llama", n_layer=1, n_head=4, n_embd=16)
    with pytest.raises(ConfigError) as error:
        GPTConfig(**{**base, **fields})
    assert words in str(error.value)


def test_a_tensor_parallel_degree_must_divide_the_key_value_heads():
    common = dict(n_layer=2, n_head=4, block_size=8, batch_size=4)
    validate_layout(Layout(tp=2), n_kv_head=2, **common)
    with pytest.raises(ConfigError, match="parallel.tp=4 does not divide model.n_kv_head=2"):
        validate_layout(Layout(tp=4), n_kv_head=2, **common)


def test_presets_give_llama3_shapes():
    # Llama 3.1 8B: 8.03B parameters with its 128,256-token vocabulary (untied).
    config = GPTConfig.from_preset("llama3-8b", vocab_size=128256, block_size=8192)
    with torch.device("meta"):
        model = build_model(config)
    assert abs(model.num_params() / 1e9 - 8.03) < 0.01
