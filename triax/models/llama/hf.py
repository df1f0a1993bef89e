"""A transformers Llama, Qwen2 or Mistral checkpoint, for triax's Llama: its config fields and
where each parameter is stored (the inverse of triax/interop/hf/export.py's llama writer). The
tensors are stored as triax holds them (nn.Linear weights, rotary pairs in transformers' rotate-half
order), so every parameter is a plain slice of one stored tensor. Reading is triax/interop/hf/directory.py's.

A config field that changes what the model computes and that triax does not implement is refused
in one line naming it, never ignored: another activation, partial rotary embeddings, a rope
scaling other than linear and llama3, biases on attention but not MLP. A sliding attention window
is honoured by never exceeding it: the context (block_size) becomes the window, within which
sliding-window and full causal attention are the same.
"""

from __future__ import annotations

from typing import Mapping

import torch

from triax.models.checkpoint_source import CheckpointError, Source, StoredWeights
from triax.models.config import GPTConfig
from triax.models.build import build_model

MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")
# The model types whose rules the readers of families built on this block apply to their dense
# part: a sliding window always kept (Mistral's), or kept only with use_sliding_window (Qwen2's).
WINDOW_ALWAYS, WINDOW_WHEN_ASKED = "mistral", "qwen2"

# transformers' rope_type -> model.rope_scaling
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def _rope(config: dict) -> dict:
    """The rotary fields, from transformers 5's rope_parameters or the older rope_theta + rope_scaling
    (which, present, wins: as in transformers 5, and as the only one transformers 4 reads)."""
    parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise CheckpointError(f"config.json: rope_parameters={parameters!r} is not a mapping")
    if any(isinstance(value, dict) for value in parameters.values()):
        raise CheckpointError("config.json: rope_parameters differ per layer type, which triax does not implement "
                              "(one rotary embedding for every layer)")
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"config.json: rope_type={rope_type!r} is a rotary scaling triax does not implement "
                              f"(it has {', '.join(ROPE_TYPES)})")
    partial = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"config.json: partial_rotary_factor={partial!r}; triax rotates every value of a head")
    fields = {"rope_theta": float(parameters.get("rope_theta", config.get("rope_theta", 10000.0))),
              "rope_scaling": ROPE_TYPES[rope_type]}
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = float(parameters["factor"])
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=float(parameters["low_freq_factor"]),
                      rope_high_freq_factor=float(parameters["high_freq_factor"]),
                      rope_original_context=int(parameters.get("original_max_position_embeddings",
                                                               config["max_position_embeddings"])))
    return fields


def sliding_window(config: dict) -> int | None:
    """The attention window of the checkpoint's layers, if any layer has one."""
    model_type, window = config["model_type"], config.get("sliding_window")
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return None  # Qwen2 keeps the field but uses it only when asked to
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(config["num_hidden_layers"])]
        return window if "sliding_attention" in layer_types else None
    return window if model_type == "mistral" else None


# triax's model.* key -> the config.json field it comes from (for messages).
CONFIG_NAMES = {"vocab_size": "vocab_size", "block_size": "max_position_embeddings", "n_layer": "num_hidden_layers",
                "n_head": "num_attention_heads", "n_embd": "hidden_size", "n_kv_head": "num_key_value_heads",
                "head_dim": "head_dim", "intermediate_size": "intermediate_size", "norm_eps": "rms_norm_eps",
                "rope_theta": "rope_theta", "rope_factor": "factor"}


def architecture(config: dict) -> dict:
    """The GPTConfig fields the checkpoint fixes (dropout is the fine-tuning run's own choice)."""
    model_type = config["model_type"]
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise CheckpointError(f"config.json: hidden_act={activation!r}; triax's SwiGLU MLP computes silu")
    bias = False
    if model_type == "llama":
        attention_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise CheckpointError(f"config.json: attention_bias={attention_bias} with mlp_bias={mlp_bias}; triax's llama "
                                  "has biases in every linear layer (model.bias=true) or in none")
        bias = attention_bias
    if model_type == "qwen3" and config.get("attention_bias", False):
        raise CheckpointError("config.json: attention_bias=true; triax's qwen3 has no biases")
    context = config["max_position_embeddings"]
    window = sliding_window(config)
    if window is not None:
        # Within the window, sliding-window attention is causal attention: cap the context there.
        context = min(context, window)
    heads = config["num_attention_heads"]
    return {"arch": model_type, "vocab_size": config["vocab_size"], "block_size": context,
            "n_layer": config["num_hidden_layers"], "n_head": heads, "n_embd": config["hidden_size"],
            "n_kv_head": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "intermediate_size": config["intermediate_size"], "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "bias": bias, "tie_embeddings": bool(config.get("tie_word_embeddings", False)), **_rope(config)}


# Module names that differ between triax's Llama and transformers' (the rest are the same).
RENAMED = {"tok_emb": "embed_tokens", "ln_f": "norm", "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
           "attn": "self_attn", "out_proj": "o_proj"}


def hf_name(name: str, prefix: str = "model.") -> str:
    """transformers' name of triax parameter `name` (the head is outside the "model." prefix)."""
    if name == "lm_head.weight":
        return name
    if not name.startswith(("tok_emb.", "ln_f.", "layers.")):
        raise CheckpointError(f"triax parameter {name!r} has no transformers llama equivalent")
    return prefix + ".".join(RENAMED.get(part, part) for part in name.split("."))


def sources(weights: StoredWeights, model_config: GPTConfig):
    """triax parameter name -> (checkpoint tensor name, transposed?, offset): every tensor whole, as stored."""
    # Checkpoints saved from LlamaModel (no head) lack the "model." prefix.
    prefix = weights.prefix("embed_tokens.weight", ("model.", ""))

    def source_of(name: str) -> Source:
        if name == "lm_head.weight" and not weights.has(name):
            return Source(prefix + "embed_tokens.weight")  # tied: stored only as the embedding
        return Source(hf_name(name, prefix))

    return source_of


# ---- writing (`triax export --format hf`) ------------------------------------------------------

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
           "qwen3": "Qwen3ForCausalLM"}


def hf_config(config: GPTConfig) -> dict:
    """config.json for transformers' <arch>ForCausalLM computing what triax's Llama computes. The
    rotary settings are written both as transformers 5 reads them (rope_parameters) and as older
    versions do (rope_theta, rope_scaling)."""
    rope = {"rope_type": {"none": "default"}.get(config.rope_scaling, config.rope_scaling),
            "rope_theta": config.rope_theta}
    if config.rope_scaling in ("linear", "llama3"):
        rope["factor"] = config.rope_factor
    if config.rope_scaling == "llama3":
        rope.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                    original_max_position_embeddings=config.rope_original_context)
    values = {
        # (hf_moe builds on this config and names its own class)
        "architectures": [CLASSES.get(config.arch, config.arch)], "model_type": config.arch,
        "vocab_size": config.vocab_size, "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": bool(config.tie_embeddings), "attention_dropout": config.dropout,
        "rope_theta": config.rope_theta, "rope_scaling": None if config.rope_scaling == "none" else dict(rope),
        "rope_parameters": rope, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
    }
    if config.arch == "llama":
        values.update(attention_bias=bool(config.bias), mlp_bias=bool(config.bias), pretraining_tp=1)
    else:  # triax attends to the whole context: no window
        values.update(sliding_window=None)
    if config.arch in ("qwen2", "qwen3"):
        values.update(use_sliding_window=False, max_window_layers=config.n_layer)
    if config.arch == "qwen3":
        values.update(attention_bias=False)
    return values


# The architectures whose transformers class has Qwen3's per-head q/k norms.
QK_NORM_TYPES = ("qwen3",)


def export_problem(config: GPTConfig, qk_norm_types: tuple[str, ...] = QK_NORM_TYPES) -> str | None:
    """Why transformers' class of config.arch cannot compute this model, if it cannot."""
    if config.qk_norm and config.arch not in qk_norm_types:
        return (f"model option qk_norm=true has no equivalent in transformers' {config.arch}; export this run with "
                f"the plain safetensors format instead (or train model.arch={qk_norm_types[0]})")
    return None


def hf_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor]):
    """(transformers name, a function that returns that tensor from `source`, its shape), in order:
    every tensor is one of triax's under another name (the head left out when tied)."""
    with torch.device("meta"):  # the names and shapes, without memory
        shapes = {name: tuple(tensor.shape) for name, tensor in build_model(config).state_dict().items()}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # transformers ties lm_head to embed_tokens itself
        yield hf_name(name), (lambda name=name: source[name]), shape


# ---- a transformers Trainer's checkpoint-N, continued (triax/interop/hf_trainer/) ----------------

# The model types whose Trainer checkpoints `trainer.continue_from` continues.
TRAINER_TYPES = ("llama",)


def trainer_parameters(config: dict) -> list[str]:
    """LlamaForCausalLM's parameters in named_parameters() order, the order of the Trainer's
    optimizer state (a tied head is the embedding's, listed once)."""
    attention_bias, mlp_bias = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
    names = ["model.embed_tokens.weight"]
    for layer in range(config["num_hidden_layers"]):
        for module, bias in (("self_attn.q_proj", attention_bias), ("self_attn.k_proj", attention_bias),
                             ("self_attn.v_proj", attention_bias), ("self_attn.o_proj", attention_bias),
                             ("mlp.gate_proj", mlp_bias), ("mlp.up_proj", mlp_bias), ("mlp.down_proj", mlp_bias)):
            names.append(f"model.layers.{layer}.{module}.weight")
            if bias:
                names.append(f"model.layers.{layer}.{module}.bias")
        names += [f"model.layers.{layer}.input_layernorm.weight",
                  f"model.layers.{layer}.post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    return names if bool(config.get("tie_word_embeddings", False)) else names + ["lm_head.weight"]


def trainer_dropout(config: dict) -> float | None:
    """The model.dropout that drops what Llama drops: its attention_dropout (the only one it has) when it is 0."""
    return 0.0 if config.get("attention_dropout", 0.0) == 0 else None
