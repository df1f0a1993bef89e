"""gpt-oss (model.arch=gpt_oss): attention sinks, alternating sliding-window layers, experts with
biases and a clamped SwiGLU, YaRN rotary scaling (model.py); its checks and presets (config.py);
its Hugging Face adapter, MXFP4 experts included (hf.py, mxfp4.py); its tensor-parallel plan, split dims
and LoRA layers (parallel.py)."""

from triax.models.family import FamilySpec
from triax.models.gpt_oss import hf, parallel
from triax.models.gpt_oss.config import ARCHITECTURES, HONOURS, PRESETS, check
from triax.models.gpt_oss.model import BiasedMoE, ClampedExperts, GptOss, SinkAttention

SPEC = FamilySpec(name="gpt_oss", architectures=ARCHITECTURES, model=GptOss, check=check, presets=PRESETS, hf=hf,
                  tp_plan=parallel.tp_plan, tp_split_dims=parallel.TP_SPLIT_DIMS, lora_targets=parallel.LORA_TARGETS,
                  peft_names=True, honours=HONOURS)

__all__ = ["ARCHITECTURES", "BiasedMoE", "ClampedExperts", "GptOss", "PRESETS", "SPEC", "SinkAttention", "check"]
