"""A transformers GPT-2 checkpoint, for triax's GPT: its config fields and where each parameter is
stored (the inverse of triax/train/hf_export.py, which explains the mapping: fused c_attn split
into q/k/v, Conv1D weights stored transposed). Reading is triax/models/hf.py's."""

from __future__ import annotations

from triax.models.hf_files import CheckpointError, HFWeights, Source

MODEL_TYPES = ("gpt2",)

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


def sources(weights: HFWeights, model_config):
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
