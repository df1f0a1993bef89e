"""The llama family (model.arch=llama | qwen2 | mistral | qwen3): its blocks (model.py), its fields
and presets (config.py), its Hugging Face adapter (hf.py), its tensor-parallel plan, LoRA layers
and activation widths (parallel.py)."""

from triax.models.family import FamilySpec
from triax.models.llama import hf, parallel
from triax.models.llama.config import ARCHITECTURES, PRESETS, QKV_BIAS_ARCHITECTURES, check, swiglu_width
from triax.models.llama.model import Llama, RotaryEmbedding, SwiGLU, inverse_frequencies, rotate


def qkv_bias(config: object) -> bool:
    """Biases on the query/key/value projections even without model.bias (Qwen2's)."""
    return config.arch in QKV_BIAS_ARCHITECTURES


SPEC = FamilySpec(name="llama", architectures=ARCHITECTURES, model=Llama, check=check, presets=PRESETS, hf=hf,
                  tp_plan=parallel.tp_plan, tp_split_dims=parallel.TP_SPLIT_DIMS, lora_targets=parallel.LORA_TARGETS,
                  peft_names=True, layer_widths=parallel.layer_widths, qkv_bias=qkv_bias)

__all__ = ["ARCHITECTURES", "Llama", "PRESETS", "RotaryEmbedding", "SPEC", "SwiGLU", "check", "inverse_frequencies",
           "rotate", "swiglu_width"]
