"""Reading a Hugging Face `transformers` GPT-2 checkpoint into triax's GPT (the inverse of
triax/train/hf_export.py, which explains the mapping: fused c_attn split into q/k/v, Conv1D
weights stored transposed).

A checkpoint is a local directory: what `save_pretrained` writes, or a snapshot directory of the
Hugging Face cache (nothing is ever downloaded). Weights are read from safetensors files only
(`pytorch_model.bin` is a pickle, which triax never loads), and lazily: `copy_into` reads, for each
parameter, only the slice this process holds (a tensor-parallel or FSDP shard, a pipeline stage's
layers), so no process ever holds the whole model unless its layout says so.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from triax.errors import ConfigError
from triax.models.init import local_box

# transformers GPT-2 settings that triax's GPT computes; any other value is refused, not ignored.
REQUIRED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
            "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,)}
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which triax's GPT uses


class CheckpointError(ConfigError, ValueError):
    """A model.init_from checkpoint that is missing, not GPT-2, or not readable safely."""


def is_hf_gpt2(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))


def read_hf_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path} ({error}); give a directory written by save_pretrained") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise CheckpointError(f"{path} is not a GPT-2 config (model_type {config.get('model_type')!r}); "
                              "triax can start from transformers GPT-2 checkpoints only")
    for key, allowed in REQUIRED.items():
        if key in config and config[key] not in allowed:
            raise CheckpointError(f"{path}: {key}={config[key]!r} is not what triax's GPT computes "
                                  f"(it needs {allowed[0]!r})")
    n_inner = config.get("n_inner")
    if n_inner not in (None, 4 * config["n_embd"]):
        raise CheckpointError(f"{path}: n_inner={n_inner} but triax's GPT has an MLP of 4 x n_embd")
    if abs(config.get("layer_norm_epsilon", LAYER_NORM_EPS) - LAYER_NORM_EPS) > 1e-12:
        raise CheckpointError(f"{path}: layer_norm_epsilon={config['layer_norm_epsilon']} but triax's GPT uses "
                              f"{LAYER_NORM_EPS}")
    return config


def architecture(config: dict) -> dict:
    """The GPTConfig fields the checkpoint fixes (dropout is the fine-tuning run's own choice)."""
    return {"vocab_size": config["vocab_size"], "block_size": config.get("n_positions", 1024),
            "n_layer": config["n_layer"], "n_head": config["n_head"], "n_embd": config["n_embd"],
            "bias": True, "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
            "gelu": _gelu_form(config.get("activation_function", "gelu_new"))}


# transformers' activation_function -> model.gelu (GPT-2's own is gelu_new, the tanh form).
GELU_FORMS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}


def _gelu_form(name: str) -> str:
    if name not in GELU_FORMS:
        raise ConfigError(f"the checkpoint's activation_function {name!r} has no triax equivalent; "
                          f"triax's GPT takes {', '.join(GELU_FORMS)}")
    return GELU_FORMS[name]


def tokenizer_file(directory: str) -> str | None:
    path = os.path.join(directory, "tokenizer.json")
    return path if os.path.isfile(path) else None


class HFWeights:
    """The safetensors tensors of a checkpoint directory, opened lazily (one file or an index of shards)."""

    def __init__(self, directory: str):

        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.isfile(single):
            files = {None: single}
        elif os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map", {})
            files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        else:
            pickled = os.path.isfile(os.path.join(directory, "pytorch_model.bin"))
            raise CheckpointError(f"{directory} has no model.safetensors" + (
                " (only pytorch_model.bin, a pickle, which triax never loads: re-save it with "
                "save_pretrained(..., safe_serialization=True))" if pickled else "; give a save_pretrained directory"))
        self._handles = {}
        self._file_of = {}
        for name, path in files.items():
            if path not in self._handles:
                self._handles[path] = safe_open(path, framework="pt")
            if name is not None:
                self._file_of[name] = path
        if not self._file_of:  # one file: every key lives there
            handle_path = next(iter(self._handles))
            self._file_of = dict.fromkeys(self._handles[handle_path].keys(), handle_path)
        # Checkpoints saved from GPT2Model or by older transformers lack the "transformer." prefix.
        self.prefix = "transformer." if "transformer.wte.weight" in self._file_of else ""
        if self.prefix + "wte.weight" not in self._file_of:
            raise CheckpointError(f"{directory}: the safetensors weights have no wte.weight; not a GPT-2 checkpoint")

    def has(self, name: str) -> bool:
        return name in self._file_of

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}")
        return self._handles[self._file_of[name]].get_slice(name)[index]


def _source(weights: HFWeights, name: str, n_embd: int):
    """(checkpoint tensor name, transposed?, offset along the checkpoint's output dimension) of one
    triax parameter."""
    p = weights.prefix
    if name == "tok_emb.weight":
        return p + "wte.weight", False, 0
    if name == "pos_emb.weight":
        return p + "wpe.weight", False, 0
    if name.startswith("ln_f."):
        return p + name, False, 0
    if name == "lm_head.weight":
        # tied checkpoints store the head only as the embedding
        return ("lm_head.weight" if weights.has("lm_head.weight") else p + "wte.weight"), False, 0
    _, number, rest = name.split(".", 2)
    layer = f"{p}h.{number}."
    if rest.startswith(("ln_1.", "ln_2.")):
        return layer + rest, False, 0
    module, kind = rest.rsplit(".", 1)
    fused = {"attn.q_proj": 0, "attn.k_proj": 1, "attn.v_proj": 2}
    if module in fused:
        return f"{layer}attn.c_attn.{kind}", kind == "weight", fused[module] * n_embd
    renamed = {"attn.out_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
    if module in renamed:
        return f"{layer}{renamed[module]}.{kind}", kind == "weight", 0
    raise CheckpointError(f"no GPT-2 tensor for triax parameter {name!r}")


@torch.no_grad()
def copy_into(model: torch.nn.Module, weights: HFWeights, n_embd: int, vocab_size: int, stored_name=lambda n: n) -> int:
    """Overwrite every parameter of `model` (plain, DDP-unwrapped, FSDP/TP DTensor shards, a
    pipeline stage) with the checkpoint's values, reading only the slice each holds. Vocabulary
    padding rows (beyond `vocab_size`) are zeroed: they are masked out of the logits. Returns the
    number of values read."""

    read = 0
    for parameter_name, parameter in model.named_parameters():
        name = stored_name(parameter_name)
        local, offset, _ = local_box(parameter)
        if local.numel() == 0:
            continue
        source, transposed, shift = _source(weights, name, n_embd)
        box = [(start, start + size) for start, size in zip(offset, local.shape)]
        values = torch.zeros_like(local)
        if name in ("tok_emb.weight", "lm_head.weight"):
            rows = (box[0][0], min(box[0][1], vocab_size))  # padding rows stay zero
            if rows[1] > rows[0]:
                values[: rows[1] - rows[0]] = weights.slice(source, (slice(*rows), slice(*box[1]))).to(local.dtype)
        elif local.dim() == 2 and transposed:
            # Conv1D stores (in, out): our rows are its columns (past the fused q/k/v before ours)
            part = weights.slice(source, (slice(*box[1]), slice(box[0][0] + shift, box[0][1] + shift)))
            values.copy_(part.t())
        elif local.dim() == 1 and shift:
            values.copy_(weights.slice(source, (slice(box[0][0] + shift, box[0][1] + shift),)))
        else:
            values.copy_(weights.slice(source, tuple(slice(*b) for b in box)))
        local.copy_(values)
        read += values.numel()
    return read
