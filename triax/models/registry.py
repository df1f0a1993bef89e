"""The model families triax builds: the one list. Adding a family is its folder under
triax/models/ (exporting a FamilySpec named SPEC) and one line here; everything else (the config's
checks, the preset table, the parallel plans, the Hugging Face and PEFT adapters) finds it through
triax.models.family. Registration order is the order of model.arch's choices and of the presets."""

from __future__ import annotations

from triax.models import deepseek_v3, gpt2, gpt_oss, llama, moe, phi3
from triax.models.family import FAMILIES, register

for _family in (gpt2, llama, moe, gpt_oss, deepseek_v3, phi3):
    register(_family.SPEC)

__all__ = ["FAMILIES"]
