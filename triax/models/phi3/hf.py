"""A transformers Phi-3 checkpoint (Phi3ForCausalLM), for triax's Phi3: its config fields and where
each parameter is stored; and the inverse, for `triax export --format hf`.

Everything is the llama block's (triax/models/llama/hf.py) but two tensors per layer: transformers
stores attention's q, k and v as one `self_attn.qkv_proj` (rows: q, then k, then v) and the MLP's
gate and up as one `mlp.gate_up_proj` (rows: gate, then up). The reader serves each of triax's
layers as its rows of the fused tensor (`FusedRows`, reading only the rows a process holds, as
every tensor is read), after checking that the fused tensor has exactly the rows the config
gives; the writer concatenates them back.

Refused in one line, never ignored: a partial rotary embedding (Phi-4-mini's
partial_rotary_factor), LongRoPE (the 128k variants' rope_scaling), any other activation. A
sliding window (Phi-3-mini's 2047) is honoured as Mistral's is: the context becomes the window,
within which sliding-window and causal attention are the same. transformers' Phi-3 has no biases
(it ignores attention_bias), and neither has triax's.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from triax.models.build import parameter_shapes
from triax.models.checkpoint_source import CheckpointError, StoredWeights
from triax.models.config import GPTConfig
from triax.models.llama import hf as hf_llama

MODEL_TYPES = ("phi3",)
CLASSES = {"phi3": "Phi3ForCausalLM"}
CONFIG_NAMES = {**hf_llama.CONFIG_NAMES, "block_size": "max_position_embeddings / sliding_window"}

# triax's layer in a block -> (transformers' fused layer, the parts it holds in row order).
FUSED = {"attn.q_proj": ("self_attn.qkv_proj", ("q", "k", "v")), "attn.k_proj": ("self_attn.qkv_proj", ("q", "k", "v")),
         "attn.v_proj": ("self_attn.qkv_proj", ("q", "k", "v")), "mlp.gate_proj": ("mlp.gate_up_proj", ("gate", "up")),
         "mlp.up_proj": ("mlp.gate_up_proj", ("gate", "up"))}
PART = {"attn.q_proj": "q", "attn.k_proj": "k", "attn.v_proj": "v", "mlp.gate_proj": "gate", "mlp.up_proj": "up"}
# A part's stored name: the fused tensor's, with its rows ("...qkv_proj.weight[32:48]").
ROWS = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


def part_rows(config: GPTConfig) -> dict[str, int]:
    """The rows each part of a fused tensor has."""
    kv = config.n_kv_head * config.head_dim
    return {"q": config.n_head * config.head_dim, "k": kv, "v": kv, "gate": config.intermediate_size,
            "up": config.intermediate_size}


def rows_of(config: GPTConfig, module: str) -> tuple[int, int, int]:
    """(start, stop, the fused tensor's rows) of triax's layer `module` ("attn.k_proj") in its fused tensor."""
    sizes = part_rows(config)
    parts = FUSED[module][1]
    start = sum(sizes[part] for part in parts[:parts.index(PART[module])])
    return start, start + sizes[PART[module]], sum(sizes[part] for part in parts)


# ---- reading -----------------------------------------------------------------------------------

def _rope_problem(config: dict) -> str | None:
    """Why triax's rotary positions differ from this checkpoint's, if they do."""
    parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        return f"rope_scaling={parameters!r} is not a mapping"
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind != "default":
        return (f"rope_scaling type={kind!r} (Phi-3's long-context LongRoPE) is a rotary scaling triax does not "
                "implement; use the model's short-context (4k) variant")
    # Both places are read (transformers 5 reads rope_parameters', earlier versions the top-level one).
    for partial in (config.get("partial_rotary_factor", 1.0), parameters.get("partial_rotary_factor", 1.0)):
        if partial != 1.0:
            return (f"partial_rotary_factor={partial!r}: the checkpoint rotates only part of each head, triax "
                    "rotates every value of a head")
    return None


def sliding_window(config: dict) -> int | None:
    """Phi-3's attention window (every layer's), if it has one."""
    window = config.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise CheckpointError(f"config.json: sliding_window={window!r} must be a positive integer or null")
    return window


def architecture(config: dict) -> dict:
    """The GPTConfig fields the checkpoint fixes: the llama block's, the context capped at the window."""
    problem = _rope_problem(config)
    if problem:
        raise CheckpointError(f"config.json: {problem}")
    fields = hf_llama.architecture(config)
    window = sliding_window(config)
    if window is not None:  # within the window, sliding-window attention is causal attention
        fields["block_size"] = min(fields["block_size"], window)
    return fields


class FusedRows:
    """A checkpoint's tensors (HFWeights), plus each part of a fused tensor as a tensor of its own:
    a name "<fused>[start:stop]" stands for those rows of <fused>, whose row count must be `rows`
    (the parts' sum the config gives) for any part to be read."""

    def __init__(self, weights: StoredWeights, rows: Mapping[str, int]):
        self.weights, self.rows = weights, rows  # fused layer name ("self_attn.qkv_proj") -> its rows

    def __getattr__(self, name: str):
        return getattr(self.weights, name)  # prefix, directory...

    def has(self, name: str) -> bool:
        part = ROWS.match(name)
        return self.weights.has(part.group(1) if part else name)

    def entry(self, name: str) -> tuple:
        part = ROWS.match(name)
        if not part:
            return self.weights.entry(name)
        fused, start, stop = part.group(1), int(part.group(2)), int(part.group(3))
        stored = self.weights.entry(fused)
        rows = next(rows for layer, rows in self.rows.items() if fused.endswith(f"{layer}.weight"))
        if len(stored.shape) != 2 or stored.shape[0] != rows:
            raise CheckpointError(f"the checkpoint's {fused} has shape {list(stored.shape)}, but its config.json "
                                  f"gives it {rows} rows ({' + '.join(self._parts(fused))}); the weights do not "
                                  "belong to this config")
        return stored._replace(shape=(stop - start, stored.shape[1]))  # the reader's TensorEntry

    def _parts(self, fused: str) -> list[str]:
        return ["q, k, v"] if "qkv_proj" in fused else ["gate, up"]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        part = ROWS.match(name)
        if not part:
            return self.weights.slice(name, index)
        fused, start, stop = part.group(1), int(part.group(2)), int(part.group(3))
        first, last, _ = index[0].indices(stop - start)
        return self.weights.slice(fused, (slice(start + first, start + last), *index[1:]))


def wrap_weights(weights: StoredWeights, model_config: GPTConfig) -> FusedRows:
    sizes = part_rows(model_config)
    return FusedRows(weights, {"self_attn.qkv_proj": sizes["q"] + sizes["k"] + sizes["v"],
                               "mlp.gate_up_proj": sizes["gate"] + sizes["up"]})


def sources(weights: FusedRows, model_config: GPTConfig):
    """triax parameter name -> Source: the llama block's, q/k/v and gate/up as rows of the fused tensors."""
    prefix = weights.prefix("embed_tokens.weight", ("model.", ""))
    dense = hf_llama.sources(weights, model_config)

    def source_of(name: str):
        parts = name.split(".")
        module = ".".join(parts[2:4])
        if parts[0] == "layers" and module in FUSED and parts[-1] == "weight":
            start, stop, _ = rows_of(model_config, module)
            return dense(name)._replace(name=f"{prefix}layers.{parts[1]}.{FUSED[module][0]}.weight[{start}:{stop}]")
        return dense(name)

    return source_of


# ---- writing (`triax export --format hf`) ------------------------------------------------------

def hf_config(config: GPTConfig) -> dict:
    """config.json for transformers' Phi3ForCausalLM computing what triax's Phi3 computes (the whole
    context attended, no rotary scaling, every value of a head rotated)."""
    values = hf_llama.hf_config(config)
    values.update(architectures=[CLASSES[config.arch]], original_max_position_embeddings=config.block_size,
                  resid_pdrop=config.dropout, embd_pdrop=config.dropout, partial_rotary_factor=1.0,
                  pad_token_id=None, sliding_window=None)
    return values


def export_problem(config: GPTConfig) -> str | None:
    """Why transformers' Phi3ForCausalLM cannot compute this model, if it cannot."""
    if config.qk_norm:
        return ("model option qk_norm=true has no equivalent in transformers' Phi-3; export this run with the plain "
                "safetensors format instead")
    return None


def hf_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor]):
    """(transformers name, a function that returns that tensor from `source`, its shape), in order:
    the llama block's tensors, each layer's q, k, v and gate, up concatenated into its fused tensor."""
    for name, shape in parameter_shapes(config).items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        parts = name.split(".")
        module = ".".join(parts[2:4])
        if parts[0] != "layers" or module not in FUSED:
            yield hf_llama.hf_name(name), (lambda name=name: source[name]), shape
            continue
        fused, order = FUSED[module]
        if PART[module] != order[0]:
            continue  # written with the first part
        prefix = ".".join(parts[:2]) + "."
        names = [prefix + next(m for m, p in PART.items() if p == part) + ".weight" for part in order]
        rows = rows_of(config, module)[2]
        yield (f"model.{prefix}{fused}.weight", (lambda names=names: torch.cat([source[n] for n in names])),
               (rows, shape[1]))
