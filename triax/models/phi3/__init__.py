"""Phi-3 (model.arch=phi3; Phi-3-mini/medium, Phi-3.5-mini and Phi-4 are built on it): the llama
block (model.py: RMSNorm, grouped-query attention with rotary positions, SwiGLU), its fields and
presets (config.py), its Hugging Face adapter, which splits the checkpoint's fused qkv_proj and
gate_up_proj on reading and fuses them on writing (hf.py), its tensor-parallel plan, LoRA layers
and activation widths (parallel.py: the llama block's, on triax's separate layers)."""

from triax.models.family import FamilySpec
from triax.models.phi3 import hf, parallel
from triax.models.phi3.config import ARCHITECTURES, PRESETS, check
from triax.models.phi3.model import Phi3

# peft_names=False: PEFT adapts transformers' fused qkv_proj and gate_up_proj as one layer each, not
# as triax's separate q/k/v and gate/up adapters, so `triax export --format peft` refuses (--merge works).
SPEC = FamilySpec(name="phi3", architectures=ARCHITECTURES, model=Phi3, check=check, presets=PRESETS, hf=hf,
                  tp_plan=parallel.tp_plan, tp_split_dims=parallel.TP_SPLIT_DIMS, lora_targets=parallel.LORA_TARGETS,
                  peft_names=False, layer_widths=parallel.layer_widths)

__all__ = ["ARCHITECTURES", "PRESETS", "Phi3", "SPEC", "check"]
