"""gpt-oss's tensor-parallel facts: its block plan, the dims `triax plan` counts split, and the
layers LoRA adapts.

The block plan is the mixture of experts' (triax/models/moe/parallel.py: attention split by heads,
the routed MLP whole on every rank); the per-head sinks split by head with the column-parallel
q_proj (rank r holds heads r x n_head / tp onwards): "attn.sinks" below."""

from __future__ import annotations

import torch.nn as nn

from triax.models import block_parts
from triax.models.moe import parallel as moe_parallel


def tp_plan(block: nn.Module) -> dict[str, str]:
    """{module name in the block: its tensor-parallel style}."""
    plan = moe_parallel.tp_plan(block)
    if getattr(block.attn, "sinks", None) is not None:
        plan["attn"] = "gather_sequence_head_params"
    return plan


TP_SPLIT_DIMS = {**block_parts.TP_SPLIT_DIMS, "attn.sinks": 0}

# The attention's linear layers (the experts are batched weights, not Linear layers).
LORA_TARGETS = {name: block_parts.LORA_TARGETS[name] for name in ("q", "k", "v", "o")}
