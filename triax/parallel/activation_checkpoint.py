"""Activation checkpointing: trade recomputation in backward for activation memory.

- full: keep only each block's input; its whole forward is recomputed during backward.
- selective: keep the outputs of the expensive ops (matmuls, attention) and recompute only the
  cheap element-wise ones (LayerNorm, GELU, dropout, adds), which hold most activation bytes per FLOP.

The block's forward is wrapped in place rather than the block replaced by a wrapper module, so
parameter names (and therefore checkpoints) do not change.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Ops whose outputs selective checkpointing keeps: recomputing them would cost a matmul.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, blocks: Iterable[nn.Module] | None = None,
                                   offload: bool = False) -> nn.Module:
    """Checkpoint each of `blocks` (default: a GPT's `model.layers`) in `mode`. With `offload`, the
    inputs each checkpoint keeps for its recomputation wait in host memory until backward (the
    activation that grows with sequence length), pinned when a GPU will fetch them back."""
    if mode == "none":
        return model
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _policy)
                  if mode == "selective" else None)
    for block in (model.layers.values() if blocks is None else blocks):
        forward = block.forward
        kwargs = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        block.forward = functools.partial(checkpoint, forward, **kwargs)
        if offload:
            block.forward = functools.partial(_saved_on_host, block.forward, torch.cuda.is_available())
    return model


def _saved_on_host(forward: Callable, pin_memory: bool, *args: Any, **kwargs: Any):
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
        return forward(*args, **kwargs)
