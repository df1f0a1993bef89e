"""Phi-3 (model.arch=phi3) against transformers' Phi3ForCausalLM, in one process: a tiny random
checkpoint (fp32, q/k/v and gate/up fused as transformers stores them) computes transformers' LM
loss in triax (|rel| <= 1e-5), in one process and through `triax eval`; greedy generation through
the cache is transformers' token for token; the export fuses the tensors back under transformers'
names and loads in AutoModelForCausalLM; a window, a fused tensor or a rotary setting triax cannot
honour is one line."""

import json

import pytest
import torch
import torch.nn.functional as F

from support.llama_checkpoints import VOCAB
from support.phi3_checkpoints import copy_checkpoint, hf_model, save_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

BLOCK = 32
LAYER = "model.layers.1"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_corpus):
    """(save_pretrained directory with tokenizer.json, the transformers model)."""
    directory = tmp_path_factory.mktemp("phi3")
    return directory, save_checkpoint(directory, tiny_corpus)


def windows(seed=1):
    return torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).item()


def test_lm_loss_equals_transformers(checkpoint):
    """fp32: the two differ only in summation order; a q/k/v or gate/up row mix-up moves the loss
    by the size of the weights' perturbation (0.05), far past 1e-5."""
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoint
    ours = load_hf_model(str(directory), torch.device("cpu"))
    assert ours.config.arch == "phi3" and ours.config.n_kv_head == 2 and ours.config.rope_theta == 5000.0
    ids = windows()
    with torch.no_grad():
        expected = reference(ids, labels=ids).loss.item()
        got = lm_loss(ours(ids), ids)
    assert abs(got - expected) / expected <= 1e-5, (got, expected)


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
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoint
    ours = load_hf_model(str(directory), torch.device("cpu"))
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20,
                                      pad_token_id=0, attention_mask=torch.ones_like(prompt))
    cached = ours.generate(prompt, 20, greedy=True)
    assert torch.equal(cached, ours.generate(prompt, 20, greedy=True, use_cache=False))
    assert torch.equal(cached, expected)


def test_the_export_fuses_the_tensors_back_and_loads_in_transformers(checkpoint, tmp_path):
    from triax.interop.hf.export import export_hf
    from triax.interop.hf.whole_model import load_hf_model

    directory, reference = checkpoint
    ours = load_hf_model(str(directory), torch.device("cpu"))
    export_hf(ours.config, ours.state_dict(), str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "phi3" and config["architectures"] == ["Phi3ForCausalLM"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert type(exported).__name__ == "Phi3ForCausalLM"
    assert exported.state_dict().keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():  # qkv_proj and gate_up_proj row for row
        assert torch.equal(exported.state_dict()[name], tensor), name
    ids = windows(seed=4)
    with torch.no_grad():
        assert exported(ids, labels=ids).loss.item() == pytest.approx(reference(ids, labels=ids).loss.item(), rel=1e-5)


def test_a_sliding_window_is_honoured_by_the_context(tmp_path):
    """Phi-3-mini's window (2047 of its 4096 positions) here 16 of 64: the context becomes the
    window, within which transformers' sliding-window attention is causal attention."""
    from triax.interop.hf.whole_model import load_hf_model

    reference = save_checkpoint(tmp_path, sliding_window=16)
    ours = load_hf_model(str(tmp_path), torch.device("cpu"))
    assert ours.config.block_size == 16
    ids = windows()[:, :16]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def _drop_rows(name):
    return lambda tensors: tensors.__setitem__(name, tensors[name][:-8].clone())


HOSTILE = {
    "qkv_proj short of rows": (_drop_rows(f"{LAYER}.self_attn.qkv_proj.weight"), None,
                               f"{LAYER}.self_attn.qkv_proj.weight has shape [56, 32], but its config.json gives it "
                               "64 rows (q, k, v)"),
    "gate_up_proj short of rows": (_drop_rows(f"{LAYER}.mlp.gate_up_proj.weight"), None,
                                   "gate_up_proj.weight has shape [120, 32], but its config.json gives it 128 rows"),
    "qkv_proj missing": (lambda t: t.pop(f"{LAYER}.self_attn.qkv_proj.weight"), None,
                         f"no tensor '{LAYER}.self_attn.qkv_proj.weight[0:32]'"),
    "a partial rotary embedding (Phi-4-mini's)": (None, lambda c: c.__setitem__("partial_rotary_factor", 0.75),
                                                  "partial_rotary_factor=0.75"),
    "longrope (the 128k variants')": (None, lambda c: c.__setitem__("rope_scaling", {
        "type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}), "rope_scaling type='longrope'"),
    "another activation": (None, lambda c: c.__setitem__("hidden_act", "gelu"), "hidden_act='gelu'"),
    "a window of no tokens": (None, lambda c: c.__setitem__("sliding_window", 0), "sliding_window=0"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_what_triax_cannot_honour_is_one_line(case, checkpoint, tmp_path):
    from triax.interop.hf.files import CheckpointError
    from triax.interop.hf.whole_model import load_hf_model

    directory, _ = checkpoint
    change_tensors, change_config, words = HOSTILE[case]
    copy_checkpoint(directory, tmp_path / "damaged", change_tensors, change_config)
    with pytest.raises(CheckpointError) as error:
        load_hf_model(str(tmp_path / "damaged"), torch.device("cpu"))
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("fields, words", [
    (dict(rope_scaling="llama3"), "rope_scaling='llama3' with model.arch=phi3: choose one of none"),
    (dict(bias=True), "transformers' phi3 has no such option"),
    (dict(n_kv_head=3), "n_kv_head=3 does not divide model.n_head=4"),
])
def test_fields_are_checked(fields, words):
    from triax.errors import ConfigError
    from triax.models import GPTConfig

    base = dict(vocab_size=50, block_size=16, arch="phi3", n_layer=1, n_head=4, n_embd=16)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        GPTConfig(**{**base, **fields})


def test_phi4_preset_counts_phi4s_parameters_and_plans():
    """Phi-4: 40 layers of 5120, 40 query heads on 10 key/value heads, a 17,920-wide MLP and
    100,352 tokens, untied: 14.66B parameters (its model card's "14B"). `triax plan` counts them
    as the model holds them, and splits the key/value heads under tensor parallelism."""
    from triax.models import GPTConfig, PRESETS, build_model
    from triax.parallel.plan import ModelShape

    config = GPTConfig.from_preset("phi-4", vocab_size=PRESETS["phi-4"]["vocab_size"], block_size=16384)
    with torch.device("meta"):
        model = build_model(config)
    assert round(model.num_params() / 1e9, 2) == 14.66
    assert ModelShape.from_config(config).num_params() == model.num_params()
    attention = 5120 * (5120 + 2 * 10 * 128) + 5120 * 5120
    assert model.num_params() == 2 * 100352 * 5120 + 40 * (attention + 3 * 5120 * 17920 + 2 * 5120) + 5120


def test_the_debug_preset_builds_and_runs_on_a_cpu():
    from triax.models import GPTConfig, build_model

    model = build_model(GPTConfig.from_preset("phi3-debug", vocab_size=64, block_size=16))
    assert type(model).__name__ == "Phi3" and model(torch.randint(0, 64, (1, 16))).shape == (1, 16, 64)
