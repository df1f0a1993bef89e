"""GPT-2's block under tensor parallelism, the dims `triax plan` counts split, and the layers LoRA
adapts: the shared block's (triax/models/block_parts.py explains the style names)."""

from __future__ import annotations

import torch.nn as nn

from triax.models.block_parts import ATTENTION_PLAN, LORA_TARGETS, MLP_PLAN, TP_SPLIT_DIMS


def tp_plan(block: nn.Module) -> dict[str, str]:
    """{module name in the block: its tensor-parallel style}."""
    return {**ATTENTION_PLAN, **MLP_PLAN}


__all__ = ["LORA_TARGETS", "TP_SPLIT_DIMS", "tp_plan"]
