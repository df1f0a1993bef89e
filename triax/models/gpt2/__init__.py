"""The GPT-2 family (model.arch=gpt2): its blocks (model.py), its fields and presets (config.py), its
Hugging Face adapter (hf.py), its tensor-parallel plan and LoRA layers (parallel.py)."""

from triax.models.family import FamilySpec
from triax.models.gpt2 import hf, parallel
from triax.models.gpt2.config import ARCHITECTURES, GELU_FORMS, PRESETS, check
from triax.models.gpt2.model import GPT, MLP

SPEC = FamilySpec(name="gpt2", architectures=ARCHITECTURES, model=GPT, check=check, presets=PRESETS, hf=hf,
                  tp_plan=parallel.tp_plan, tp_split_dims=parallel.TP_SPLIT_DIMS, lora_targets=parallel.LORA_TARGETS)

__all__ = ["ARCHITECTURES", "GELU_FORMS", "GPT", "MLP", "PRESETS", "SPEC", "check"]
