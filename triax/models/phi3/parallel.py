"""Phi-3 under tensor parallelism, in `triax plan` and under LoRA: the llama block's plan, split
dims, LoRA layers and activation widths, since triax holds q, k, v, gate and up as separate layers
(heads split per rank) whatever the checkpoint fuses."""

from __future__ import annotations

from triax.models.llama.parallel import LORA_TARGETS, TP_SPLIT_DIMS, layer_widths, tp_plan

__all__ = ["LORA_TARGETS", "TP_SPLIT_DIMS", "layer_widths", "tp_plan"]
