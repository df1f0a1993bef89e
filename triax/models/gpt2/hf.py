"""A transformers GPT-2 checkpoint, for triax's GPT: its config fields and where each parameter is
stored (the inverse of hf_tensors below; triax/interop/hf/export.py explains the mapping: fused c_attn split
into q/k/v, Conv1D weights stored transposed). Reading the files is triax/interop/hf/'s."""

from __future__ import annotations

import math
from typing import Mapping

import torch

from triax.models.checkpoint_source import CheckpointError, Source, StoredWeights
from triax.models.config import GPTConfig

MODEL_TYPES = ("gpt2",)
CLASSES = {"gpt2": "GPT2LMHeadModel"}

# transformers GPT-2 settings that triax's GPT computes; any other value is refused, not ignored.
REQUIRED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh", "gelu"), "scale_attn_weights": (True,),
            "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,)}

# transformers' activation_function -> model.gelu (GPT-2's own is gelu_new, the tanh form).
GELU_FORMS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}


# triax's model.* key -> the config.json field it comes from (for messages).
CONFIG_NAMES = {"vocab_size": "vocab_size", "block_size": "n_positions", "n_layer": "n_layer", "n_head": "n_head",
                "n_embd": "n_embd", "intermediate_size": "n_inner", "norm_eps": "layer_norm_epsilon"}


def architecture(config: dict) -> dict:
    """The GPTConfig fields the checkpoint fixes (dropout is the fine-tuning run's own choice)."""
    for key, allowed in REQUIRED.items():
        if key in config and config[key] not in allowed:
            raise CheckpointError(f"config.json: {key}={config[key]!r} is not what triax's GPT computes "
                                  f"(it takes {', '.join(map(repr, allowed))})")
    return {"arch": "gpt2", "vocab_size": config["vocab_size"], "block_size": config.get("n_positions", 1024),
            "n_layer": config["n_layer"], "n_head": config["n_head"], "n_embd": config["n_embd"],
            "intermediate_size": config.get("n_inner") or 4 * config["n_embd"],
            "norm_eps": config.get("layer_norm_epsilon", 1e-5),
            "bias": True, "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
            "gelu": GELU_FORMS[config.get("activation_function", "gelu_new")]}


def sources(weights: StoredWeights, model_config: GPTConfig):
    """triax parameter name -> (checkpoint tensor name, transposed?, offset along its output dimension)."""
    # Checkpoints saved from GPT2Model or by older transformers lack the "transformer." prefix.
    p = weights.prefix("wte.weight", ("transformer.", ""))
    n_embd = model_config.n_embd

    def source_of(name: str) -> Source:
        if name == "tok_emb.weight":
            return Source(p + "wte.weight")
        if name == "pos_emb.weight":
            return Source(p + "wpe.weight")
        if name.startswith("ln_f."):
            return Source(p + name)
        if name == "lm_head.weight":
            # tied checkpoints store the head only as the embedding
            return Source("lm_head.weight" if weights.has("lm_head.weight") else p + "wte.weight")
        _, number, rest = name.split(".", 2)
        layer = f"{p}h.{number}."
        if rest.startswith(("ln_1.", "ln_2.")):
            return Source(layer + rest)
        module, kind = rest.rsplit(".", 1)
        fused = {"attn.q_proj": 0, "attn.k_proj": 1, "attn.v_proj": 2}
        if module in fused:
            return Source(f"{layer}attn.c_attn.{kind}", kind == "weight", fused[module] * n_embd, fused=True)
        renamed = {"attn.out_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
        if module in renamed:
            return Source(f"{layer}{renamed[module]}.{kind}", kind == "weight")
        raise CheckpointError(f"no GPT-2 tensor for triax parameter {name!r}")

    return source_of


# ---- writing (`triax export --format hf`) ------------------------------------------------------

# model.gelu -> transformers' activation_function
HF_ACTIVATIONS = {"tanh": "gelu_new", "exact": "gelu"}


def hf_config(config: GPTConfig) -> dict:
    """config.json for transformers' GPT2LMHeadModel computing what triax's GPT computes."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size, "n_ctx": config.block_size,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head,
        "n_inner": config.intermediate_size,
        "activation_function": HF_ACTIVATIONS[config.gelu], "layer_norm_epsilon": config.norm_eps,
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(config.tie_embeddings),
        "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
    }


def hf_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor]):
    """(transformers name, a function that builds that tensor from `source`, its shape), in order."""
    e, v, inner = config.n_embd, config.vocab_size, config.intermediate_size

    def copy(name: str):
        return lambda: source[name]

    def conv1d(name: str):  # Linear (out, in) -> Conv1D (in, out)
        return lambda: source[name].t()

    def bias_or_zeros(name: str, size: int, like: str):
        # bias=false: GPT-2 always has biases; zeros compute the same function.
        return lambda: source[name] if config.bias else torch.zeros(size, dtype=source[like].dtype)

    yield "transformer.wte.weight", copy("tok_emb.weight"), (v, e)
    yield "transformer.wpe.weight", copy("pos_emb.weight"), (config.block_size, e)
    for i in range(config.n_layer):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        attention = [f"{ours}attn.{p}_proj" for p in "qkv"]
        for norm in ("ln_1", "ln_2"):
            yield f"{theirs}{norm}.weight", copy(f"{ours}{norm}.weight"), (e,)
            yield f"{theirs}{norm}.bias", bias_or_zeros(f"{ours}{norm}.bias", e, f"{ours}{norm}.weight"), (e,)
        yield (f"{theirs}attn.c_attn.weight",
               lambda names=attention: torch.cat([source[f"{n}.weight"] for n in names], dim=0).t(), (e, 3 * e))
        yield (f"{theirs}attn.c_attn.bias",
               (lambda names=attention: torch.cat([source[f"{n}.bias"] for n in names]))
               if config.bias else (lambda name=f"{ours}ln_1.weight": torch.zeros(3 * e, dtype=source[name].dtype)),
               (3 * e,))
        for mine, hf, shape in (("attn.out_proj", "attn.c_proj", (e, e)), ("mlp.up_proj", "mlp.c_fc", (e, inner)),
                                ("mlp.down_proj", "mlp.c_proj", (inner, e))):
            yield f"{theirs}{hf}.weight", conv1d(f"{ours}{mine}.weight"), shape
            yield f"{theirs}{hf}.bias", bias_or_zeros(f"{ours}{mine}.bias", shape[1], f"{ours}{mine}.weight"), (shape[1],)
    yield "transformer.ln_f.weight", copy("ln_f.weight"), (e,)
    yield "transformer.ln_f.bias", bias_or_zeros("ln_f.bias", e, "ln_f.weight"), (e,)
    if not config.tie_embeddings:  # tied: transformers ties lm_head to wte itself
        yield "lm_head.weight", copy("lm_head.weight"), (v, e)


# ---- a transformers Trainer's checkpoint-N, continued (triax/interop/hf_trainer/) ----------------

# The model types whose Trainer checkpoints `trainer.continue_from` continues.
TRAINER_TYPES = ("gpt2",)


def trainer_parameters(config: dict) -> list[str]:
    """GPT2LMHeadModel's parameters in named_parameters() order, the order of the Trainer's
    optimizer state (a tied head, GPT-2's default, is the embedding's, listed once)."""
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for layer in range(config["n_layer"]):
        for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{layer}.{module}.weight", f"transformer.h.{layer}.{module}.bias"]
    names += ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    return names if bool(config.get("tie_word_embeddings", True)) else names + ["lm_head.weight"]


def trainer_dropout(config: dict) -> float | None:
    """The model.dropout that drops what GPT-2 drops: its three rates when they are one rate."""
    rates = {config.get(key, 0.1) for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    rate = rates.pop() if len(rates) == 1 else None
    finite = isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate)
    return float(rate) if finite and 0 <= rate < 1 else None
