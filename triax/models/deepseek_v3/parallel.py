"""Latent attention under tensor parallelism (names -> styles, as triax/models/block_parts.py
explains), and the dims `triax plan` counts split.

The heads are split: q_b_proj (or q_proj) and kv_b_proj are column-parallel (each rank makes its
heads' queries, keys and values), out_proj row-parallel. The latents are not split: every rank
computes q_a_proj, kv_a_proj_with_mqa and their norms whole ("replicate": replicated weights, the
outputs kept as DTensors, so the gradients the ranks' heads give back are summed by DTensor), and the
rotary key, shared by every head, becomes a plain tensor of this rank's heads at `rope_key`, its
gradient this rank's part of the sum ("local_partial"). A dense MLP is split as Llama's; a routed one
runs whole on every rank (triax/models/moe/parallel.py). Also the activation widths `triax plan`
counts for a block, and the layers LoRA adapts."""

from __future__ import annotations

import torch.nn as nn

from triax.models import block_parts
from triax.models.config import GPTConfig
from triax.models.moe.parallel import routed, whole_mlp

# The norms around the attention and the MLP, and the attention's output: Megatron-LM's.
AROUND = {name: style for name, style in block_parts.ATTENTION_PLAN.items()
          if name not in ("attn.q_proj", "attn.k_proj", "attn.v_proj")}
LATENTS = {"attn.kv_a_proj_with_mqa": "replicate", "attn.kv_a_layernorm": "replicate", "attn.kv_b_proj": "colwise",
           "attn.rope_key": "local_partial"}
QUERY_LATENT = {"attn.q_a_proj": "replicate", "attn.q_a_layernorm": "replicate", "attn.q_b_proj": "colwise"}


def tp_plan(block: nn.Module) -> dict[str, str]:
    """{module name in the block: its tensor-parallel style}."""
    queries = QUERY_LATENT if hasattr(block.attn, "q_b_proj") else {"attn.q_proj": "colwise"}
    mlp = {"mlp.gate_proj": "colwise", **block_parts.MLP_PLAN} if hasattr(block.mlp, "gate_proj") else {}
    plan = {**AROUND, **queries, **LATENTS, **mlp}
    return whole_mlp(plan) if routed(block) else plan


TP_SPLIT_DIMS = {**block_parts.TP_SPLIT_DIMS, "gate_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0}


def lora_targets(config: GPTConfig) -> dict[str, str]:
    """model.lora.targets' names -> the layer in a block: the query projection (q) or the query
    latent's two (q_a, q_b), the key/value latent's two (kv_a, kv_b) and the output (o). Not the
    MLPs: on transformers' DeepseekV3ForCausalLM, PEFT takes gate_proj, up_proj and down_proj to mean
    the routed experts' fused weights (as they were named before transformers 5 batched them), so
    an adapter on the dense or shared MLPs could not be loaded by PEFT as triax computes it."""
    queries = {"q_a": "attn.q_a_proj", "q_b": "attn.q_b_proj"} if config.q_lora_rank else {"q": "attn.q_proj"}
    return {**queries, "kv_a": "attn.kv_a_proj_with_mqa", "kv_b": "attn.kv_b_proj", "o": "attn.out_proj"}


def layer_widths(config: GPTConfig) -> int:
    """Values per token a routed block keeps for backward (triax/parallel/plan.py's docstring, counted as
    for the llama block): the block's input, its residual after attention and each RMSNorm's input and
    output (6h); the latents, before and after their norms (2 q_lora_rank + 2 kv_lora_rank +
    qk_rope_head_dim); the rotated queries and keys, the values and the attention output, every head's
    (2 H q + 2 H v, q and v a head's query/key and value widths); the SwiGLU's four tensors of each of
    the token's experts and of the shared experts (4 k I + 4 S), and the router's scores (E)."""
    heads = config.n_head
    latents = 2 * (config.q_lora_rank or 0) + 2 * config.kv_lora_rank + config.qk_rope_head_dim
    attention = 2 * heads * config.head_dim + 2 * heads * config.v_head_dim
    if config.num_experts:
        mlp = (4 * config.experts_per_token * config.moe_intermediate_size
               + 4 * config.shared_expert_intermediate_size + config.num_experts)
    else:
        mlp = 4 * config.intermediate_size
    return 6 * config.n_embd + latents + attention + mlp
