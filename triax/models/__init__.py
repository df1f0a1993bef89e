from triax.models.config import ARCHITECTURES, PRESETS, GPTConfig
from triax.models.decoder import VOCABULARY_PARAMETERS, Decoder, KVCache, vocabulary_rows
from triax.models.gpt import GPT
from triax.models.llama import Llama

FAMILIES = {"gpt": GPT, "llama": Llama}


def build_model(config: GPTConfig, **parts) -> Decoder:
    """The model of `config`'s architecture (GPT or Llama); `parts` as Decoder takes them (a
    pipeline stage's layers, embeddings, head; the seed)."""
    return FAMILIES[config.family](config, **parts)


__all__ = ["ARCHITECTURES", "Decoder", "GPT", "GPTConfig", "KVCache", "Llama", "PRESETS", "VOCABULARY_PARAMETERS",
           "build_model", "vocabulary_rows"]
