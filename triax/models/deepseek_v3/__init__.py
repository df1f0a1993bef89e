"""DeepSeek-V3 (model.arch=deepseek_v3; Kimi K2 and Moonlight are built on it): multi-head latent
attention, group-limited sigmoid routing with a correction bias, shared experts, leading dense
layers. Its blocks (model.py, attention.py), fields (checks.py), presets (presets.py), Hugging Face
adapter (hf.py), tensor-parallel plan and LoRA layers (parallel.py)."""

from triax.models.deepseek_v3 import hf, parallel
from triax.models.deepseek_v3.checks import HONOURS, check
from triax.models.deepseek_v3.model import DeepseekV3, RoutedMLP
from triax.models.deepseek_v3.presets import PRESETS
from triax.models.family import FamilySpec

ARCHITECTURES = ("deepseek_v3",)

SPEC = FamilySpec(name="deepseek_v3", architectures=ARCHITECTURES, model=DeepseekV3, check=check, presets=PRESETS,
                  hf=hf, tp_plan=parallel.tp_plan, tp_split_dims=parallel.TP_SPLIT_DIMS,
                  lora_targets=parallel.lora_targets, peft_names=True, layer_widths=parallel.layer_widths,
                  honours=HONOURS)

__all__ = ["ARCHITECTURES", "DeepseekV3", "PRESETS", "RoutedMLP", "SPEC", "check"]
