"""gpt-oss's tensor-parallel facts: the dims `triax plan` counts split, and the layers LoRA adapts.

No tensor-parallel block plan yet: the experts' batched weights are not Linear layers, and triax
refuses tensor parallelism of every mixture of experts (triax/parallel/experts.py), sharding the
experts with FSDP and expert parallelism instead. When it has one, the per-head sinks split by head
with the column-parallel q_proj (rank r holds heads r x n_head / tp onwards): "attn.sinks" below."""

from __future__ import annotations

from triax.models import block_parts

TP_SPLIT_DIMS = {**block_parts.TP_SPLIT_DIMS, "attn.sinks": 0}

# The attention's linear layers (the experts are batched weights, not Linear layers).
LORA_TARGETS = {name: block_parts.LORA_TARGETS[name] for name in ("q", "k", "v", "o")}
