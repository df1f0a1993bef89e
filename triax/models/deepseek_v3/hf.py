"""A transformers DeepSeek-V3 checkpoint (DeepseekV3ForCausalLM; Kimi K2 and Moonlight are this
model_type too), for triax's DeepseekV3 (model.py): its config fields, where each tensor is stored,
and the inverse for `triax export --format hf`.

The blocks' names are transformers' but for the Llama renames (llama/hf.py's RENAMED: attn ->
self_attn, out_proj -> o_proj...), the shared experts (`shared_expert` -> `shared_experts`) and the
correction bias of the router's scores (triax's `mlp.expert_bias` buffer is transformers'
`mlp.gate.e_score_correction_bias`). Each expert's three Linears are stacked as moe/hf.py's ExpertStack
serves them. The multi-token prediction layers a released checkpoint holds after the last layer
(model.layers.<n_layer>.*) are not read: the next-token model does not use them.

Released weights stored as 8-bit floats with a scale per 128 x 128 block are dequantized on load,
by the slice each process reads, by the reader (triax/interop/hf/block_fp8.py), for any family.
"""

from __future__ import annotations

from typing import Mapping

import torch

from triax.models.build import parameter_shapes
from triax.models.checkpoint_source import EXPERT_SLOT, CheckpointError, Source, StoredWeights
from triax.models.config import GPTConfig
from triax.models.json_kinds import first_type_error
from triax.models.llama import hf as hf_llama
from triax.models.moe import hf as hf_moe

MODEL_TYPES = ("deepseek_v3",)
CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM"}

# The config.json fields only this model_type has, with their JSON kinds (the reader checks the shared
# ones: triax/models/json_kinds.py); "?" also accepts null (only the query latent is optional:
# transformers' model fails on a null anywhere else).
FIELDS = {"q_lora_rank": "int?", "kv_lora_rank": "int", "qk_nope_head_dim": "int", "qk_rope_head_dim": "int",
          "v_head_dim": "int", "n_routed_experts": "int", "n_shared_experts": "int", "n_group": "int",
          "topk_group": "int", "routed_scaling_factor": "float", "first_k_dense_replace": "int",
          "num_experts_per_tok": "int", "norm_topk_prob": "bool", "moe_intermediate_size": "int",
          "rope_interleave": "bool?", "scoring_func": "str", "topk_method": "str", "moe_layer_freq": "int"}
# transformers' DeepseekV3Config defaults: what a config.json without the field means.
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
            "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "num_experts_per_tok": 8, "norm_topk_prob": True,
            "moe_intermediate_size": 2048, "rms_norm_eps": 1e-6}

# The GPTConfig fields config.json expresses beyond those every family's writer maps (export.py).
MAPPED_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "router_groups", "router_topk_groups", "routed_scaling_factor", "first_dense_layers",
                 "router_scoring", "shared_expert_intermediate_size")

# triax's model.* key -> the config.json field it comes from (for messages).
CONFIG_NAMES = {**hf_llama.CONFIG_NAMES, "num_experts": "n_routed_experts", "experts_per_token": "num_experts_per_tok",
                "moe_intermediate_size": "moe_intermediate_size", "router_groups": "n_group",
                "router_topk_groups": "topk_group", "routed_scaling_factor": "routed_scaling_factor",
                "first_dense_layers": "first_k_dense_replace", "q_lora_rank": "q_lora_rank",
                "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
                "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"}



def type_error(config: dict) -> str | None:
    """The first of this model_type's own fields of a JSON type transformers would refuse, or None."""
    return first_type_error(config, FIELDS)


def _refuse_unsupported(config: dict) -> None:
    """One line for a field that changes what the model computes in a way triax does not."""
    problem = type_error(config)
    if problem is not None:
        raise CheckpointError(f"config.json: {problem}")
    refused = {"attention_bias": (False,), "hidden_act": ("silu",), "rope_interleave": (True, None),
               "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "moe_layer_freq": (1,)}
    for name, allowed in refused.items():
        if name in config and config[name] not in allowed:
            raise CheckpointError(f"config.json: {name}={config[name]!r}; triax's deepseek_v3 computes "
                                  f"{name}={allowed[0]!r} only")


# YaRN's parameters that triax's yarn.py computes with the released values only (a parameter left out
# takes transformers' default, the same).
YARN_AS_RELEASED = {"mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": None}
# The JSON kinds of the YaRN parameters it reads (the reader checks factor's and the context's).
YARN_FIELDS = {"beta_fast": "float?", "beta_slow": "float?", "truncate": "bool"}


def _rope(config: dict) -> dict:
    """The rotary fields: transformers 5's rope_parameters, or the older rope_theta + rope_scaling."""
    parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    theta = {"rope_theta": float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return theta
    if rope_type != "yarn":
        raise CheckpointError(f"config.json: rope_type={rope_type!r}; triax's deepseek_v3 computes the original "
                              "rotary frequencies or YaRN's (rope_type default or yarn)")
    for name, released in YARN_AS_RELEASED.items():
        if parameters.get(name, released) != released:
            raise CheckpointError(f"config.json: rope_parameters.{name}={parameters[name]!r}; triax computes YaRN "
                                  f"with {name}={released!r} only, as DeepSeek-V3 is released")
    problem = first_type_error(parameters, YARN_FIELDS, "rope_parameters.")
    if problem is not None:
        raise CheckpointError(f"config.json: {problem}")
    return {**theta, "rope_scaling": "yarn", "rope_factor": float(parameters["factor"]),
            "rope_original_context": parameters.get("original_max_position_embeddings",
                                                    config["max_position_embeddings"]),
            "rope_beta_fast": float(parameters.get("beta_fast") or 32),
            "rope_beta_slow": float(parameters.get("beta_slow") or 1),
            "rope_truncate": parameters.get("truncate", True)}


def architecture(config: dict) -> dict:
    """The GPTConfig fields the checkpoint fixes (a field it lacks: transformers' DeepseekV3Config default)."""
    _refuse_unsupported(config)

    def value(name: str):
        return config.get(name, DEFAULTS[name])

    moe_width = value("moe_intermediate_size")
    return {"arch": "deepseek_v3", "vocab_size": config["vocab_size"], "block_size": config["max_position_embeddings"],
            "n_layer": config["num_hidden_layers"], "n_head": config["num_attention_heads"],
            "n_embd": config["hidden_size"], "intermediate_size": config["intermediate_size"],
            "norm_eps": float(value("rms_norm_eps")), "bias": False,
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)), **_rope(config),
            "q_lora_rank": value("q_lora_rank"), "kv_lora_rank": value("kv_lora_rank"),
            "qk_nope_head_dim": value("qk_nope_head_dim"), "qk_rope_head_dim": value("qk_rope_head_dim"),
            "v_head_dim": value("v_head_dim"), "num_experts": value("n_routed_experts"),
            "experts_per_token": value("num_experts_per_tok"), "moe_intermediate_size": moe_width,
            "router_scoring": "sigmoid", "norm_topk_prob": value("norm_topk_prob"),
            "shared_expert_intermediate_size": value("n_shared_experts") * moe_width,
            "router_groups": value("n_group"), "router_topk_groups": value("topk_group"),
            "routed_scaling_factor": float(value("routed_scaling_factor")),
            "first_dense_layers": value("first_k_dense_replace")}


def stored_name(name: str, prefix: str = "model.") -> str:
    """transformers' name of triax parameter (or buffer) `name`; an expert tensor with EXPERT_SLOT."""
    parts = name.split(".")
    if len(parts) > 3 and parts[2] == "mlp":
        layer, rest = parts[1], parts[3:]
        if rest[0] == "experts":
            return f"{prefix}layers.{layer}.mlp.experts.{EXPERT_SLOT}.{rest[1]}.weight"
        if rest[0] == "expert_bias":
            return f"{prefix}layers.{layer}.mlp.gate.e_score_correction_bias"
        if rest[0] == "shared_expert":
            return f"{prefix}layers.{layer}.mlp.shared_experts.{'.'.join(rest[1:])}"
    return hf_llama.hf_name(name, prefix)


def hf_name(name: str, prefix: str = "model.") -> str:
    """transformers' name of triax parameter `name` (PEFT names an adapted layer's adapters after it)."""
    return stored_name(name, prefix)


def wrap_weights(weights: StoredWeights, model_config: GPTConfig) -> hf_moe.ExpertStack:
    return hf_moe.ExpertStack(weights, model_config.num_experts)


def sources(weights: hf_moe.ExpertStack, model_config: GPTConfig):
    """triax parameter or buffer name -> Source. Every routed layer's correction bias must be there
    (a buffer: copy_into reads the buffers a checkpoint holds, so a missing one is refused here)."""
    prefix = weights.prefix("embed_tokens.weight", ("model.", ""))
    for layer in range(model_config.n_layer):
        bias = stored_name(f"layers.{layer}.mlp.expert_bias", prefix)
        if model_config.has_experts(layer) and not weights.has(bias):
            raise CheckpointError(f"the checkpoint has no tensor {bias!r}, the correction bias of layer {layer}'s "
                                  "expert scores its config.json implies; the weights do not belong to this config")
    dense = hf_llama.sources(weights, model_config)

    def source_of(name: str) -> Source:
        if name == "lm_head.weight":
            return dense(name)
        return Source(stored_name(name, prefix))

    return source_of


# ---- writing (`triax export --format hf`) ------------------------------------------------------

def export_problem(config: GPTConfig) -> str | None:
    """Why transformers' DeepseekV3ForCausalLM cannot compute this model, if it cannot."""
    if not config.num_experts:
        return ("a latent-attention model without experts (model.num_experts=0) has no transformers class: export "
                "this run with the plain safetensors format instead")
    if config.shared_expert_intermediate_size % config.moe_intermediate_size:
        return (f"model.shared_expert_intermediate_size={config.shared_expert_intermediate_size} is not a whole number "
                f"of experts of moe_intermediate_size={config.moe_intermediate_size}, as transformers' n_shared_experts "
                "counts them: export this run with the plain safetensors format instead")
    return None


def hf_config(config: GPTConfig) -> dict:
    """config.json for transformers' DeepseekV3ForCausalLM."""
    base = hf_llama.hf_config(config)
    shared = config.shared_expert_intermediate_size // config.moe_intermediate_size
    values = {key: value for key, value in base.items() if key not in ("head_dim", "sliding_window")}
    values.update(
        architectures=[CLASSES["deepseek_v3"]], model_type="deepseek_v3", num_key_value_heads=config.n_head,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope_interleave=True,
        n_routed_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
        moe_intermediate_size=config.moe_intermediate_size, n_shared_experts=shared,
        n_group=config.router_groups, topk_group=config.router_topk_groups,
        routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=bool(config.norm_topk_prob),
        first_k_dense_replace=config.first_dense_layers, attention_bias=False, num_nextn_predict_layers=0)
    if config.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": config.rope_theta, "factor": config.rope_factor,
                "original_max_position_embeddings": config.rope_original_context, "beta_fast": config.rope_beta_fast,
                "beta_slow": config.rope_beta_slow, "truncate": config.rope_truncate,
                **{name: value for name, value in YARN_AS_RELEASED.items() if value is not None}}
        values.update(rope_parameters=rope, rope_scaling=dict(rope))
    return values


def hf_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor]):
    """(transformers name, a function returning that tensor from `source`, its shape): each expert's
    three Linears cut from triax's batched weights, and each routed layer's correction bias."""
    shapes = dict(parameter_shapes(config))
    for layer in range(config.n_layer):
        if config.has_experts(layer):
            shapes[f"layers.{layer}.mlp.expert_bias"] = (config.num_experts,)
    return hf_moe.expert_tensors(config, source, shapes, stored_name)
