"""The model families triax builds: the one list. Adding a family is its folder under
triax/models/ and one line here; everything else (the config's checks, the preset table, the
parallel plans, the Hugging Face and PEFT adapters) finds it through triax.models.family.
Registration order is the order of model.arch's choices and of the preset table."""

from __future__ import annotations

from triax.models import gpt, llama, moe
from triax.models.family import FAMILIES, register

for _spec in (gpt.SPEC, llama.SPEC, moe.SPEC):
    register(_spec)

__all__ = ["FAMILIES"]
