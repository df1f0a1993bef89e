"""The mixture-of-experts block under tensor parallelism (names -> styles, as
triax/models/block_parts.py explains): the attention split by heads as the llama block's, the
routed MLP computed whole on every rank ("whole": its parameters replicated, its input gathered
from the sequence slices); a dense layer's MLP split as the llama block's."""

from __future__ import annotations

import torch.nn as nn

from triax.models import block_parts
from triax.models.llama import parallel as llama_parallel


def routed(block: nn.Module) -> bool:
    """Whether the block's MLP is routed (it has a router, `gate`)."""
    return hasattr(block.mlp, "gate") and hasattr(block.mlp, "experts")


def whole_mlp(plan: dict[str, str]) -> dict[str, str]:
    """`plan` with the MLP's entries replaced by the routed MLP computed whole on every rank."""
    return {**{name: style for name, style in plan.items() if name != "mlp" and not name.startswith("mlp.")},
            "mlp": "whole"}


def tp_plan(block: nn.Module) -> dict[str, str]:
    """{module name in the block: its tensor-parallel style}."""
    plan = llama_parallel.tp_plan(block)
    return whole_mlp(plan) if routed(block) else plan


TP_SPLIT_DIMS = llama_parallel.TP_SPLIT_DIMS
