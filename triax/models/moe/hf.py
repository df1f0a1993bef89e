"""A transformers Mixtral or Qwen3-MoE checkpoint, for triax's Mixture (model.py): its
config fields and where each parameter is stored; and the inverse, for `triax export --format hf`.

Everything but the MLPs is the Llama family's (triax/models/llama/hf.py). transformers saves each expert as
its own three Linear weights (`...experts.<e>.w1.weight` for Mixtral, `...experts.<e>.gate_proj.weight`
for Qwen3-MoE); triax holds each layer's experts as one batched tensor [experts, out, in]. The
reader serves such a tensor from the per-expert ones (`ExpertStack`): its shape is checked over every
expert (a missing, extra or misshapen expert is one line) and a slice reads only the experts it covers.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from triax.models.build import parameter_shapes
from triax.models.checkpoint_source import EXPERT_SLOT, CheckpointError, Source, StoredWeights
from triax.models.config import GPTConfig
from triax.models.llama import hf as hf_llama

MODEL_TYPES = ("mixtral", "qwen3_moe")
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# Per model_type: the MLP module's name, and triax's expert weight -> transformers' per-expert Linear.
MLP_MODULE = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
EXPERT_LINEARS = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                  "qwen3_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}}

CONFIG_NAMES = {**hf_llama.CONFIG_NAMES, "num_experts": "num_experts / num_local_experts",
                "experts_per_token": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
                "decoder_sparse_step": "decoder_sparse_step", "mlp_only_layers": "mlp_only_layers",
                "router_aux_loss_coef": "router_aux_loss_coef"}


def num_experts(config: dict) -> int:
    """Qwen3-MoE's configs name it num_experts (transformers 5 writes num_local_experts, as Mixtral's)."""
    named = {key: config[key] for key in ("num_experts", "num_local_experts") if config.get(key) is not None}
    if len(set(map(repr, named.values()))) > 1:
        # Each transformers class reads one of them; which one depends on the class, so neither is guessed.
        raise CheckpointError(f"config.json gives num_experts={named['num_experts']!r} and num_local_experts="
                              f"{named['num_local_experts']!r}; a checkpoint has one expert count: make them agree")
    value = next(iter(named.values()), None)
    if value is None:
        raise CheckpointError("config.json has neither num_experts nor num_local_experts; not a mixture of experts "
                              "transformers wrote")
    return value


def architecture(config: dict) -> dict:
    """The GPTConfig fields the checkpoint fixes."""
    model_type = config["model_type"]
    if config.get("attention_bias", False):
        raise CheckpointError("config.json: attention_bias=true; triax's qwen3_moe has no biases")
    jitter = config.get("router_jitter_noise", 0.0)
    if jitter:
        raise CheckpointError(f"config.json: router_jitter_noise={jitter!r}; triax's router adds no noise "
                              "(set it to 0)")
    fields = hf_llama.architecture(_dense(config))  # the llama reader's rules
    fields.update(arch=model_type, num_experts=num_experts(config),
                  experts_per_token=config.get("num_experts_per_tok", 2),
                  router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))
    if model_type == "qwen3_moe":
        fields.update(moe_intermediate_size=config["moe_intermediate_size"],
                      norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                      decoder_sparse_step=config.get("decoder_sparse_step", 1),
                      mlp_only_layers=list(config.get("mlp_only_layers") or []))
    return fields


def sliding_window(config: dict) -> int | None:
    """The attention window of the checkpoint's layers: Mixtral keeps Mistral's window, Qwen3-MoE
    Qwen2's switch."""
    return hf_llama.sliding_window(_dense(config))


def _dense(config: dict) -> dict:
    """The config as the llama reader takes it: Mixtral's as Mistral's (a window always kept),
    Qwen3-MoE's as Qwen2's (a window only with use_sliding_window)."""
    like = hf_llama.WINDOW_ALWAYS if config["model_type"] == "mixtral" else hf_llama.WINDOW_WHEN_ASKED
    return {**config, "model_type": like}


class ExpertStack:
    """A checkpoint's tensors (HFWeights), plus the batched expert tensors triax holds, each served
    from its per-expert tensors: a name holding EXPERT_SLOT stands for all `experts` of them, stacked."""

    def __init__(self, weights: StoredWeights, experts: int):
        self.weights, self.experts = weights, experts

    def __getattr__(self, name: str):
        return getattr(self.weights, name)  # prefix, directory...

    def has(self, name: str) -> bool:
        if EXPERT_SLOT not in name:
            return self.weights.has(name)
        return self.weights.has(name.format(expert=0))

    def entry(self, name: str) -> tuple:
        if EXPERT_SLOT not in name:
            return self.weights.entry(name)
        first = self.weights.entry(name.format(expert=0))
        for expert in range(1, self.experts):
            stored = name.format(expert=expert)
            if not self.weights.has(stored):
                raise CheckpointError(f"the checkpoint has no tensor {stored!r}, but its config.json gives "
                                      f"{self.experts} experts; the weights do not belong to this config")
            if self.weights.entry(stored) != first:
                raise CheckpointError(f"the checkpoint's {stored} is {self.weights.entry(stored)}, expert 0's is "
                                      f"{first}; every expert of a layer has one shape and dtype")
        if self.weights.has(name.format(expert=self.experts)):
            raise CheckpointError(f"the checkpoint holds {name.format(expert=self.experts)!r}, past the "
                                  f"{self.experts} experts its config.json gives; the weights do not belong to "
                                  "this config")
        return first._replace(shape=(self.experts, *first.shape))  # the reader's TensorEntry

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if EXPERT_SLOT not in name:
            return self.weights.slice(name, index)
        experts, rest = index[0], tuple(index[1:])
        return torch.stack([self.weights.slice(name.format(expert=e), rest)
                            for e in range(*experts.indices(self.experts))])


def wrap_weights(weights: StoredWeights, model_config: GPTConfig) -> ExpertStack:
    return ExpertStack(weights, model_config.num_experts)


def stored_name(name: str, arch: str, prefix: str = "model.") -> str:
    """transformers' name of triax parameter `name` (an expert tensor: with EXPERT_SLOT for the expert)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[2] == "mlp" and parts[3] in ("gate", "experts"):
        layer, module = parts[1], MLP_MODULE[arch]
        if parts[3] == "gate":
            return f"{prefix}layers.{layer}.{module}.gate.weight"
        linear = EXPERT_LINEARS[arch][parts[4]]
        return f"{prefix}layers.{layer}.{module}.experts.{EXPERT_SLOT}.{linear}.weight"
    return hf_llama.hf_name(name, prefix)


def sources(weights: ExpertStack, model_config: GPTConfig):
    """triax parameter name -> Source (expert tensors: a stacked name ExpertStack serves)."""
    prefix = weights.prefix("embed_tokens.weight", ("model.", ""))
    dense = hf_llama.sources(weights, model_config)

    def source_of(name: str) -> Source:
        if name == "lm_head.weight":
            return dense(name)
        return Source(stored_name(name, model_config.arch, prefix))

    return source_of


# ---- writing (`triax export --format hf`) ------------------------------------------------------

def hf_config(config: GPTConfig) -> dict:
    """config.json for transformers' MixtralForCausalLM or Qwen3MoeForCausalLM."""
    base = hf_llama.hf_config(config)
    values = {key: value for key, value in base.items() if key not in ("use_sliding_window", "max_window_layers")}
    values.update(architectures=[CLASSES[config.arch]], model_type=config.arch, num_local_experts=config.num_experts,
                  num_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
                  router_aux_loss_coef=config.router_aux_loss_coef, output_router_logits=False)
    if config.arch == "mixtral":
        values.update(router_jitter_noise=0.0)
    else:
        values.update(moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                      decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=list(config.mlp_only_layers),
                      attention_bias=False, use_sliding_window=False, max_window_layers=config.n_layer)
    return values


def export_problem(config: GPTConfig) -> str | None:
    """Why transformers' class of config.arch cannot compute this model, if it cannot."""
    return hf_llama.export_problem(config, ("qwen3_moe",))


def hf_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor]):
    """(transformers name, a function returning that tensor from `source`, its shape): the
    llama family's tensors, each expert's three Linears cut from triax's batched weights."""
    return expert_tensors(config, source, parameter_shapes(config), lambda name: stored_name(name, config.arch))


def expert_tensors(config: GPTConfig, source: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple],
                   stored_name: Callable[[str], str]):
    """hf_tensors of a family with batched experts: each of `shapes` under its transformers name
    (`stored_name`), an expert tensor (EXPERT_SLOT in its name) cut into one tensor per expert."""
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        stored = stored_name(name)
        if EXPERT_SLOT not in stored:
            yield stored, (lambda name=name: source[name]), shape
            continue
        for expert in range(config.num_experts):
            yield (stored.format(expert=expert), (lambda name=name, expert=expert: source[name][expert]),
                   tuple(shape[1:]))
