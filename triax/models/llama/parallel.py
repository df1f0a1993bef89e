"""The llama block under tensor parallelism (names -> styles, as triax/models/block_parts.py
explains), the dims `triax plan` counts split, the layers LoRA adapts, and the activation widths
`triax plan` counts for one block."""

from __future__ import annotations

import torch.nn as nn

from triax.models.config import GPTConfig
from triax.models import block_parts


def tp_plan(block: nn.Module) -> dict[str, str]:
    """{module name in the block: its tensor-parallel style}. Qwen3's per-head q/k norms see this
    rank's heads (dim 1 of the (batch, heads, seq, head_dim) tensor): their gains are replicated
    and their gradients, partial per rank, summed by DTensor."""
    head_norms = {f"attn.{name}": "head_sequence" for name in ("q_norm", "k_norm")
                  if getattr(block.attn, name, None) is not None}
    gate = {"mlp.gate_proj": "colwise"} if hasattr(block.mlp, "gate_proj") else {}
    return {**head_norms, **block_parts.ATTENTION_PLAN, **gate, **block_parts.MLP_PLAN}


TP_SPLIT_DIMS = {**block_parts.TP_SPLIT_DIMS, "gate_proj.weight": 0, "gate_proj.bias": 0}

LORA_TARGETS = {**block_parts.LORA_TARGETS, "gate": "mlp.gate_proj"}


def layer_widths(config: GPTConfig) -> int:
    """Values per token one block keeps for backward (triax/parallel/plan.py's docstring): 8h, the
    rotated keys and the values (2k), the SwiGLU's four I-wide tensors."""
    return 8 * config.n_embd + 2 * config.n_kv_head * config.head_dim + 4 * config.intermediate_size
