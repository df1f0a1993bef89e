"""Phi-3's decoder: the llama block as it is (triax/models/llama/model.py). Phi-3 differs from Llama
only in how its checkpoint stores the block (q, k and v fused, gate and up fused: hf.py), so triax
keeps its separate layers, which tensor parallelism splits by heads and LoRA adapts one by one."""

from __future__ import annotations

from triax.models.llama import Llama


class Phi3(Llama):
    """model.arch=phi3: Llama's blocks (see Llama and Decoder for the arguments)."""

    family = "phi3"
