"""A transformers GptOssForCausalLM checkpoint, for triax's GptOss: its config fields and where
each parameter is stored; and the inverse, for `triax export --format hf`.

Names are the llama family's (embed_tokens, self_attn.q_proj, o_proj, input_layernorm, ...),
plus `self_attn.sinks` and the MLP's `router` (triax's `gate`, a Linear with a bias). The
experts differ in layout: transformers holds each layer's as
- `experts.gate_up_proj` [experts, n_embd, 2 x width]: input-major (the transpose of nn.Linear's),
  the gate's and the up projection's outputs interleaved (column 2i is gate i, 2i + 1 up i), with
  `gate_up_proj_bias` [experts, 2 x width] interleaved alike;
- `experts.down_proj` [experts, width, n_embd] (input-major too) and `down_proj_bias`;
- or, in the released checkpoints, the two weights in MXFP4 (`gate_up_proj_blocks` / `_scales`,
  `down_proj_blocks` / `_scales`, output-major), dequantized on load (mxfp4.py).
triax holds gate_proj, up_proj [experts, width, n_embd] and down_proj [experts, n_embd, width]
(nn.Linear's layout per expert, as moe.GroupedExperts) with a bias each. `ExpertLayout` serves
each of them, by the slice a rank holds, from whichever form the checkpoint has.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from triax.models.checkpoint_source import CheckpointError, Source, StoredWeights
from triax.models.config import GPTConfig
from triax.models.json_kinds import first_type_error
from triax.models.gpt_oss import mxfp4
from triax.models.gpt_oss.model import FULL, SLIDING, GptOss

MODEL_TYPES = ("gpt_oss",)
CLASSES = {"gpt_oss": "GptOssForCausalLM"}
# No `sliding_window(config)` here (the llama family's caps the context at the window): gpt_oss
# computes its windows, so a run from the checkpoint keeps the checkpoint's whole context.

# The JSON type of each config.json field this reader takes beyond the llama family's (which
# triax/models/json_kinds.py checks for every family), as transformers' GptOssConfig declares it.
FIELD_KINDS = {"swiglu_limit": "float", "swiglu_alpha": "float", "sliding_window": "int?",
               "num_local_experts": "int", "num_experts_per_tok": "int", "quantization_config": "dict?",
               "attention_bias": "bool", "layer_types": "list[str]?"}
ROPE_KINDS = {"beta_fast": "float", "beta_slow": "float", "truncate": "bool", "attention_factor": "float?",
              "mscale": "float?", "mscale_all_dim": "float?"}

# triax's model.* key -> the config.json field it comes from (for messages).
CONFIG_NAMES = {"vocab_size": "vocab_size", "block_size": "max_position_embeddings", "n_layer": "num_hidden_layers",
                "n_head": "num_attention_heads", "n_embd": "hidden_size", "n_kv_head": "num_key_value_heads",
                "head_dim": "head_dim", "intermediate_size": "intermediate_size", "norm_eps": "rms_norm_eps",
                "num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok",
                "sliding_window": "sliding_window", "layer_types": "layer_types", "swiglu_limit": "swiglu_limit",
                "swiglu_alpha": "swiglu_alpha", "rope_theta": "rope_theta", "rope_factor": "factor",
                "rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow",
                "rope_original_context": "original_max_position_embeddings"}



def _check_kinds(values: dict, kinds: dict, where: str) -> None:
    problem = first_type_error(values, kinds, where)
    if problem is not None:
        raise CheckpointError(f"config.json: {problem}")


def _rope(config: dict) -> dict:
    """The rotary fields: transformers 5's rope_parameters (or the older rope_scaling + rope_theta)."""
    parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(parameters, dict) or any(isinstance(value, dict) for value in parameters.values()):
        raise CheckpointError(f"config.json: rope_parameters={str(parameters)[:60]} is not one mapping of numbers")
    _check_kinds(parameters, ROPE_KINDS, "rope_parameters.")
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise CheckpointError(f"config.json: rope_type={rope_type!r}; triax's gpt_oss implements default and yarn")
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("config.json: partial_rotary_factor is not 1; triax rotates every value of a head")
    fields = {"rope_theta": float(parameters.get("rope_theta", config.get("rope_theta", 150000.0))),
              "rope_scaling": "none" if rope_type == "default" else "yarn"}
    if rope_type == "yarn":
        original = int(parameters["original_max_position_embeddings"])
        factor = parameters.get("factor") or config["max_position_embeddings"] / original
        gain, mscale, mscale_all = (parameters.get(key) for key in ("attention_factor", "mscale", "mscale_all_dim"))
        if gain is None and mscale and mscale_all:  # DeepSeek's form: a ratio of two YaRN gains
            gain = (0.1 * mscale * math.log(factor) + 1.0) / (0.1 * mscale_all * math.log(factor) + 1.0)
        fields.update(rope_factor=float(factor), rope_original_context=original,
                      rope_beta_fast=float(parameters.get("beta_fast") or 32.0),
                      rope_beta_slow=float(parameters.get("beta_slow") or 1.0),
                      rope_truncate=bool(parameters.get("truncate", True)),
                      rope_attention_factor=None if gain is None else float(gain))
    return fields


def architecture(config: dict) -> dict:
    """The GPTConfig fields the checkpoint fixes (dropout is the fine-tuning run's own choice)."""
    _check_kinds(config, FIELD_KINDS, "")
    quantization = config.get("quantization_config") or {}
    if quantization and quantization.get("quant_method") != "mxfp4":
        raise CheckpointError(f"config.json: quantization_config.quant_method={quantization.get('quant_method')!r}; "
                              "triax reads gpt_oss weights unquantized or in MXFP4 (dequantized on load)")
    heads = config["num_attention_heads"]
    window = config.get("sliding_window")
    layer_types = config.get("layer_types") or [SLIDING if layer % 2 == 0 else FULL
                                                for layer in range(config["num_hidden_layers"])]
    if window is None:  # transformers' masks ignore the layer types without a window
        layer_types = [FULL] * len(layer_types)
    return {"arch": "gpt_oss", "vocab_size": config["vocab_size"], "block_size": config["max_position_embeddings"],
            "n_layer": config["num_hidden_layers"], "n_head": heads, "n_embd": config["hidden_size"],
            "n_kv_head": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "intermediate_size": config["intermediate_size"], "norm_eps": float(config.get("rms_norm_eps", 1e-5)),
            "bias": bool(config.get("attention_bias", True)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "num_experts": config["num_local_experts"], "experts_per_token": config.get("num_experts_per_tok", 4),
            "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)), "attention_sinks": True,
            "sliding_window": window, "layer_types": list(layer_types),
            "swiglu_limit": float(config.get("swiglu_limit", 7.0)), "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
            **_rope(config)}


# Module names that differ between triax's GptOss and transformers' (the rest are the same).
RENAMED = {"tok_emb": "embed_tokens", "ln_f": "norm", "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
           "attn": "self_attn", "out_proj": "o_proj"}
# triax's expert tensor -> (transformers' tensor holding it, which interleaved half: 0 gate, 1 up, None whole)
EXPERT_TENSORS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
                  "gate_proj_bias": ("gate_up_proj_bias", 0), "up_proj_bias": ("gate_up_proj_bias", 1),
                  "down_proj_bias": ("down_proj_bias", None)}
# How a triax expert tensor's source is named: the stored tensor, and what of it (read by ExpertLayout).
SERVED = " (as triax's "


def hf_name(name: str, prefix: str = "model.") -> str:
    """transformers' name of triax parameter `name` (an expert tensor: its stored tensor's)."""
    if name == "lm_head.weight":
        return name
    parts = name.split(".")
    if len(parts) > 3 and parts[2] == "mlp":
        if parts[3] == "gate":
            return f"{prefix}layers.{parts[1]}.mlp.router.{parts[4]}"
        return f"{prefix}layers.{parts[1]}.mlp.experts.{EXPERT_TENSORS[parts[4]][0]}"
    if not name.startswith(("tok_emb.", "ln_f.", "layers.")):
        raise CheckpointError(f"triax parameter {name!r} has no transformers gpt_oss equivalent")
    return prefix + ".".join(RENAMED.get(part, part) for part in parts)


def sources(weights: "ExpertLayout", model_config: GPTConfig):
    """triax parameter name -> Source (an expert tensor: a name ExpertLayout serves)."""
    prefix = weights.prefix("embed_tokens.weight", ("model.", ""))

    def source_of(name: str) -> Source:
        if name == "lm_head.weight" and not weights.has(name):
            return Source(prefix + "embed_tokens.weight")  # tied: stored only as the embedding
        parts = name.split(".")
        if len(parts) > 4 and parts[2:4] == ["mlp", "experts"]:
            return Source(f"{hf_name(name, prefix)}{SERVED}{parts[4]})")
        return Source(hf_name(name, prefix))

    return source_of


class ExpertLayout:
    """A checkpoint's tensors (StoredWeights), plus triax's expert tensors, each served in triax's
    layout from transformers' (interleaved, input-major, or MXFP4): a name `<stored>` + SERVED +
    `<triax tensor>)` stands for that tensor."""

    def __init__(self, weights: StoredWeights):
        self.weights = weights

    def __getattr__(self, name: str):
        return getattr(self.weights, name)  # prefix, directory...

    def has(self, name: str) -> bool:
        return SERVED in name or self.weights.has(name)

    def entry(self, name: str) -> tuple:
        if SERVED not in name:
            return self.weights.entry(name)
        stored, tensor = _split(name)
        half = EXPERT_TENSORS[tensor][1]
        if tensor.endswith("_bias"):
            dtype, shape = self._stored_entry(stored)
            return (dtype, (shape[0], shape[1] // 2) if half is not None else shape)
        if self.weights.has(stored):  # input-major: transposed, and halved along the (last) output dimension
            dtype, (experts, inputs, outputs) = self._stored_entry(stored, dims=3)
            return (dtype, (experts, outputs // 2 if half is not None else outputs, inputs))
        experts, rows, columns = self._mxfp4_shape(stored)
        return ("F32", (experts, rows // 2 if half is not None else rows, columns))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if SERVED not in name:
            return self.weights.slice(name, index)
        stored, tensor = _split(name)
        half = EXPERT_TENSORS[tensor][1]
        experts, rows = index[0], index[1]
        # Rows of an interleaved tensor: the stored ones covering ours, both halves, then ours.
        stored_rows = rows if half is None else slice(2 * rows.start, 2 * rows.stop)
        pick = (lambda t: t) if half is None else (lambda t: t[:, half::2])
        if tensor.endswith("_bias"):
            return pick(self.weights.slice(stored, (experts, stored_rows)))
        if self.weights.has(stored):
            return pick(self.weights.slice(stored, (experts, index[2], stored_rows)).transpose(1, 2))
        blocks = self.weights.slice(stored + "_blocks", (experts, stored_rows, slice(None), slice(None)))
        scales = self.weights.slice(stored + "_scales", (experts, stored_rows, slice(None)))
        return pick(mxfp4.dequantize(blocks, scales))[:, :, index[2]]

    def _stored_entry(self, stored: str, dims: int = 2) -> tuple:
        if not self.weights.has(stored):
            raise CheckpointError(f"the checkpoint has no tensor {stored!r}" + (
                f" (nor {stored}_blocks / _scales in MXFP4)" if dims == 3 else ""))
        entry = self.weights.entry(stored)
        if len(entry.shape) != dims or (stored.endswith("gate_up_proj" if dims == 3 else "gate_up_proj_bias")
                                        and entry.shape[-1] % 2):
            raise CheckpointError(f"the checkpoint's {stored} has shape {list(entry.shape)}, not [experts, ...] of "
                                  f"{dims} dimensions (an even last one for gate_up); the weights are not gpt_oss's")
        return entry

    def _mxfp4_shape(self, stored: str) -> tuple[int, int, int]:
        """(experts, rows, values per row) of an MXFP4 weight, its blocks and scales checked together."""
        blocks, scales = stored + "_blocks", stored + "_scales"
        if not (self.weights.has(blocks) and self.weights.has(scales)):
            raise CheckpointError(f"the checkpoint has no tensor {stored!r} (nor {blocks} and {scales} in MXFP4)")
        block, scale = self.weights.entry(blocks), self.weights.entry(scales)
        if (block.dtype, scale.dtype) != ("U8", "U8") or len(block.shape) != 4 or block.shape[-1] != mxfp4.GROUP // 2 \
                or tuple(block.shape[:-1]) != tuple(scale.shape) or (stored.endswith("gate_up_proj")
                                                                     and block.shape[1] % 2):
            raise CheckpointError(f"the checkpoint's {blocks} is {block.dtype} {list(block.shape)} and {scales} "
                                  f"{scale.dtype} {list(scale.shape)}; MXFP4 stores uint8 [experts, rows, groups, 16] "
                                  "blocks with uint8 [experts, rows, groups] scales: the file is damaged")
        return block.shape[0], block.shape[1], block.shape[2] * mxfp4.GROUP


def _split(name: str) -> tuple[str, str]:
    stored, tensor = name.split(SERVED)
    return stored, tensor.removesuffix(")")


def wrap_weights(weights: StoredWeights, model_config: GPTConfig) -> ExpertLayout:
    return ExpertLayout(weights)


# ---- writing (`triax export --format hf`) ------------------------------------------------------

def export_problem(config: GPTConfig) -> str | None:
    """Why transformers' GptOssForCausalLM cannot compute this model, if it cannot."""
    if not config.attention_sinks:
        return ("model option attention_sinks=false has no equivalent in transformers' gpt_oss (every head has a "
                "sink); export this run with the plain safetensors format instead")
    return None


def hf_config(config: GPTConfig) -> dict:
    """config.json for transformers' GptOssForCausalLM computing what triax's GptOss computes."""
    rope = {"rope_type": "default" if config.rope_scaling == "none" else "yarn", "rope_theta": config.rope_theta}
    if config.rope_scaling == "yarn":
        rope.update(factor=config.rope_factor, beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                    truncate=config.rope_truncate, original_max_position_embeddings=config.rope_original_context)
        if config.rope_attention_factor is not None:
            rope["attention_factor"] = config.rope_attention_factor
    return {"architectures": [CLASSES["gpt_oss"]], "model_type": "gpt_oss", "vocab_size": config.vocab_size,
            "hidden_size": config.n_embd, "intermediate_size": config.moe_intermediate_size,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": bool(config.tie_embeddings), "attention_dropout": config.dropout,
            "attention_bias": bool(config.bias), "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.experts_per_token, "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": False, "sliding_window": config.sliding_window,
            "layer_types": list(config.layer_types), "swiglu_limit": config.swiglu_limit,
            "swiglu_alpha": config.swiglu_alpha, "rope_parameters": rope, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "torch_dtype": "float32"}


def hf_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor]):
    """(transformers name, a function returning that tensor from `source`, its shape), in order:
    the expert tensors interleaved and transposed back (check_mappable has refused what transformers'
    class cannot compute: no sinks, or q/k/v biases apart from o's)."""
    with torch.device("meta"):  # the names and shapes, without memory
        shapes = {name: tuple(tensor.shape) for name, tensor in GptOss(config).state_dict().items()}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # transformers ties lm_head to embed_tokens itself
        parts = name.split(".")
        if len(parts) > 4 and parts[2:4] == ["mlp", "experts"]:
            if parts[4] in ("gate_proj", "gate_proj_bias"):
                yield _fused(name, parts[4], shape, source)
            elif parts[4] in ("down_proj", "down_proj_bias"):
                transpose = parts[4] == "down_proj"
                yield (hf_name(name), (lambda name=name, t=transpose: source[name].transpose(1, 2).contiguous()
                                       if t else source[name]), (shape[0], shape[2], shape[1]) if transpose else shape)
            continue
        yield hf_name(name), (lambda name=name: source[name]), shape


def _fused(name: str, tensor: str, shape: tuple, source: Mapping[str, torch.Tensor]):
    """gate_up_proj (or its bias) from triax's gate and up tensors: interleaved, input-major."""
    gate, up = name, name.replace("gate_proj", "up_proj")
    if tensor == "gate_proj":  # [experts, width, n_embd] each -> [experts, n_embd, 2 x width]
        return (hf_name(name), lambda: torch.stack((source[gate], source[up]), dim=2).flatten(1, 2).transpose(1, 2)
                .contiguous(), (shape[0], shape[2], 2 * shape[1]))
    return hf_name(name), lambda: torch.stack((source[gate], source[up]), dim=2).flatten(1, 2), (shape[0], 2 * shape[1])
