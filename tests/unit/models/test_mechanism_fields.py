"""The optional mechanisms' fields (triax.models.config.MECHANISMS): a family that does not compute
one refuses it set away from its default, in one line naming the field, the architecture and the
architectures that do (from the registry); and every preset, as a run's model.json holds it, loads
back."""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest

import triax.models.registry  # noqa: F401 (registers the families)
from triax.errors import ConfigError
from triax.models.config import MECHANISMS, PLAN_ONLY_PRESET_KEYS, TRAINING_FIELDS, GPTConfig, preset_fields
from triax.models.family import ARCHITECTURES, FAMILIES, PRESETS
from triax.runs.files import read_model_config

# A value away from the default for each mechanism field.
SET = {"attention_sinks": True, "sliding_window": 16, "layer_types": ["full_attention"] * 4, "swiglu_limit": 7.0,
       "swiglu_alpha": 2.0, "rope_beta_fast": 16.0, "rope_beta_slow": 2.0, "rope_truncate": False,
       "rope_attention_factor": 1.2, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8, "v_head_dim": 16, "router_groups": 2, "router_topk_groups": 2,
       "routed_scaling_factor": 2.5, "first_dense_layers": 1, "num_experts": 4, "experts_per_token": 4,
       "moe_intermediate_size": 32, "norm_topk_prob": True, "router_scoring": "sigmoid",
       "router_bias_update_rate": 0.001, "shared_expert_intermediate_size": 32, "shared_expert_gate": True,
       "decoder_sparse_step": 2, "mlp_only_layers": [1]}
DEFAULTS = {field.name: field.default for field in fields(GPTConfig)}

UNHONOURED = [(name, arch) for name in MECHANISMS for arch, spec in ARCHITECTURES.items() if name not in spec.honours]


def test_every_mechanism_has_a_value_here_and_a_family_that_computes_it():
    assert set(SET) == set(MECHANISMS)
    assert all(SET[name] != DEFAULTS[name] for name in SET)
    for spec in FAMILIES.values():
        assert spec.honours <= set(MECHANISMS), spec.name
    assert all(any(name in spec.honours for spec in FAMILIES.values()) for name in MECHANISMS)
    # Training choices are given before model.init_from's checkpoint decides the architecture.
    assert not set(MECHANISMS) & set(TRAINING_FIELDS)


@pytest.mark.parametrize("name, arch", UNHONOURED, ids=[f"{name}-{arch}" for name, arch in UNHONOURED])
def test_a_mechanism_its_family_does_not_compute_is_one_line(name, arch):
    with pytest.raises(ConfigError) as error:
        GPTConfig(vocab_size=64, block_size=16, n_layer=4, arch=arch, **{name: SET[name]})
    message = str(error.value)
    doing = [other for other, spec in ARCHITECTURES.items() if name in spec.honours]
    assert "\n" not in message
    assert message.startswith(f"model.{name}={SET[name]!r} with model.arch={arch}: {arch} does not ")
    assert message.endswith(f"choose a model.arch that does ({', '.join(doing)})")
    assert doing and arch not in doing


def test_the_refusal_example():
    with pytest.raises(ConfigError, match=r"^model\.attention_sinks=True with model\.arch=llama: llama does not "
                                          r"compute attention sinks; choose a model\.arch that does \(gpt_oss\)$"):
        GPTConfig(vocab_size=64, block_size=16, arch="llama", attention_sinks=True)


def test_a_mechanism_at_its_default_is_no_refusal():
    defaults = {name: DEFAULTS[name] for name in MECHANISMS}
    assert GPTConfig(vocab_size=64, block_size=16, arch="llama", **defaults).attention_sinks is None


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_and_loads_as_a_runs_model_json(name, tmp_path):
    vocab = PRESETS[name].get(PLAN_ONLY_PRESET_KEYS[0], 256)
    config = GPTConfig(vocab_size=vocab, block_size=128, **preset_fields(name))
    assert asdict(GPTConfig(**asdict(config))) == asdict(config)
    (tmp_path / "model.json").write_text(json.dumps(config.__dict__))  # as a run writes it
    assert asdict(read_model_config(str(tmp_path))) == asdict(config)
