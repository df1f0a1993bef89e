"""The models, plain PyTorch: one config (GPTConfig), the decoder skeleton every family shares, and
the families (one folder each: triax/models/<family>/), registered in triax/models/registry.py."""

from triax.models import registry  # noqa: F401  (registers every family before any config is built)
from triax.models.build import build_model, parameter_shapes
from triax.models.config import ARCHITECTURES, PRESETS, GPTConfig
from triax.models.decoder import VOCABULARY_PARAMETERS, Decoder, KVCache, vocabulary_rows
from triax.models.gpt2 import GPT
from triax.models.llama import Llama
from triax.models.moe import Mixture

__all__ = ["ARCHITECTURES", "Decoder", "GPT", "GPTConfig", "KVCache", "Llama", "Mixture", "PRESETS",
           "VOCABULARY_PARAMETERS", "build_model", "parameter_shapes", "vocabulary_rows"]
