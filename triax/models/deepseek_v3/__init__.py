"""DeepSeek-V3 (model.arch=deepseek_v3; Kimi K2 and Moonlight are built on it): multi-head latent
attention, group-limited sigmoid routing with a correction bias, shared experts, leading dense
layers. Its blocks (model.py, attention.py), fields (checks.py), presets (presets.py) and Hugging
Face adapter (hf.py)."""

from triax.models.deepseek_v3 import hf
from triax.models.deepseek_v3.checks import check
from triax.models.deepseek_v3.model import DeepseekV3, RoutedMLP
from triax.models.deepseek_v3.presets import PRESETS
from triax.models.family import FamilySpec

ARCHITECTURES = ("deepseek_v3",)

SPEC = FamilySpec(name="deepseek_v3", architectures=ARCHITECTURES, model=DeepseekV3, check=check, presets=PRESETS,
                  hf=hf)

__all__ = ["ARCHITECTURES", "DeepseekV3", "PRESETS", "RoutedMLP", "SPEC", "check"]
