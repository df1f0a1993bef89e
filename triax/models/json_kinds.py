"""The JSON type of every config.json field triax reads, checked as transformers' config classes
check them (a leaf of models/, so every family's Hugging Face adapter, models/<family>/hf.py, checks
its own fields with the same kinds and the same message: `first_type_error`) (transformers 5 declares each field's type and refuses another: `"tie_word_embeddings":
"false"` is a str, not a bool, and is an error there, where `bool("false")` would silently be
true). A number must also be finite (`1e999` parses to infinity). The values' ranges are
GPTConfig's to check, once the fields are taken (triax/models/config.py).

The table follows transformers' LlamaConfig, Qwen2Config, MistralConfig and GPT2Config (and the
fields older versions wrote, such as rope_theta and rope_scaling at the top level). A field not
named here is not read by triax and is left to transformers.
"""

from __future__ import annotations

import math

from triax.errors import printable

# What each kind accepts, and how a message names it.
KINDS = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
    "bool": ("true or false (a JSON boolean, not a string)", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "list[str]": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "list[int]": ("a list of integers", lambda v: isinstance(v, list)
                  and all(isinstance(x, int) and not isinstance(x, bool) for x in v)),
    "int|list[int]": ("an integer or a list of integers", lambda v: (isinstance(v, int) and not isinstance(v, bool))
                      or (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v))),
}

# field -> kind; a trailing "?" also accepts null.
FIELDS = {
    # every family
    "model_type": "str", "architectures": "list[str]?", "vocab_size": "int", "tie_word_embeddings": "bool",
    "bos_token_id": "int?", "pad_token_id": "int?", "eos_token_id": "int|list[int]?", "torch_dtype": "str?",
    "dtype": "str?", "initializer_range": "float", "use_cache": "bool",
    # the llama family (Llama, Qwen2, Mistral)
    "hidden_size": "int", "intermediate_size": "int", "num_hidden_layers": "int", "num_attention_heads": "int",
    "num_key_value_heads": "int?", "head_dim": "int?", "hidden_act": "str", "max_position_embeddings": "int",
    "rms_norm_eps": "float", "rope_theta": "float", "rope_scaling": "dict?", "rope_parameters": "dict?",
    "partial_rotary_factor": "float", "attention_bias": "bool", "mlp_bias": "bool", "attention_dropout": "float?",
    "pretraining_tp": "int?", "use_sliding_window": "bool", "sliding_window": "int?", "max_window_layers": "int",
    "layer_types": "list[str]?",
    # the mixtures of experts (Mixtral, Qwen3-MoE)
    "num_local_experts": "int", "num_experts": "int", "num_experts_per_tok": "int", "moe_intermediate_size": "int",
    "norm_topk_prob": "bool", "decoder_sparse_step": "int", "mlp_only_layers": "list[int]?",
    "router_aux_loss_coef": "float", "router_jitter_noise": "float", "output_router_logits": "bool",
    # GPT-2
    "n_positions": "int", "n_ctx": "int", "n_embd": "int", "n_layer": "int", "n_head": "int", "n_inner": "int?",
    "activation_function": "str", "layer_norm_epsilon": "float", "resid_pdrop": "float", "embd_pdrop": "float",
    "attn_pdrop": "float", "scale_attn_weights": "bool", "scale_attn_by_inverse_layer_idx": "bool",
    "reorder_and_upcast_attn": "bool",
}
# The fields of rope_parameters (transformers 5) or rope_scaling (before).
ROPE_FIELDS = {"rope_type": "str", "type": "str", "rope_theta": "float", "factor": "float",
               "low_freq_factor": "float", "high_freq_factor": "float", "original_max_position_embeddings": "int",
               "partial_rotary_factor": "float"}


def type_error(config: dict) -> str | None:
    """The first field of `config` whose JSON type transformers would refuse, as a message (without
    the file's name), or None."""
    problem = first_type_error(config, FIELDS)
    if problem is None:
        for name in ("rope_parameters", "rope_scaling"):
            parameters = config.get(name)
            # Per-layer-type parameters (a mapping of mappings) are refused by the family's reader.
            if isinstance(parameters, dict) and not any(isinstance(v, dict) for v in parameters.values()):
                problem = problem or first_type_error(parameters, ROPE_FIELDS, f"{name}.")
    return problem


def first_type_error(values: dict, kinds: dict, prefix: str = "") -> str | None:
    """The first of `values`' fields named in `kinds` ({field: kind, "kind?" for one that may be
    null}) of a JSON type transformers would refuse, as a message, or None."""
    for name, kind in kinds.items():
        if name not in values:
            continue
        value, nullable = values[name], kind.endswith("?")
        if value is None and nullable:
            continue
        wanted, accepts = KINDS[kind.rstrip("?")]
        if not accepts(value):
            shown = printable(repr(value))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return (f"{prefix}{name}={shown} is a JSON {_json_type(value)}; transformers takes {wanted}"
                    + (" or null" if nullable else "") + " there")
    return None


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number" if value == value and abs(value) != math.inf else "number that is not finite"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(value), type(value).__name__)
