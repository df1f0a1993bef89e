"""The mixture-of-experts family (model.arch=mixtral | qwen3_moe): the llama block with routed
experts (model.py; the experts themselves, which other families reuse, are
triax/models/experts.py), its fields and presets (config.py), its Hugging Face adapter (hf.py).
Its tensor-parallel plan is the llama block's with the routed MLP computed whole on every rank
(parallel.py); its LoRA layers are the llama block's."""

from triax.models.experts import GroupedExperts, MoE, grouped_linear, route, update_expert_bias
from triax.models.family import FamilySpec
from triax.models.llama import parallel as llama_parallel
from triax.models.moe import hf, parallel
from triax.models.moe.config import ARCHITECTURES, HONOURS, PRESETS, check
from triax.models.moe.model import Mixture

# Its layer_widths stays unset (the GPT-2 formula): the count `triax plan` has always made for it.
SPEC = FamilySpec(name="moe", architectures=ARCHITECTURES, model=Mixture, check=check, presets=PRESETS, hf=hf,
                  tp_plan=parallel.tp_plan, tp_split_dims=parallel.TP_SPLIT_DIMS,
                  lora_targets=llama_parallel.LORA_TARGETS, peft_names=True, honours=HONOURS)

__all__ = ["ARCHITECTURES", "GroupedExperts", "Mixture", "MoE", "PRESETS", "SPEC", "check", "grouped_linear", "route",
           "update_expert_bias"]
