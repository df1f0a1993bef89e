import torch

from triax.models.config import ARCHITECTURES, PRESETS, GPTConfig
from triax.models.decoder import VOCABULARY_PARAMETERS, Decoder, KVCache, vocabulary_rows
from triax.models.gpt import GPT
from triax.models.llama import Llama

FAMILIES = {"gpt": GPT, "llama": Llama}


def build_model(config: GPTConfig, **parts) -> Decoder:
    """The model of `config`'s architecture (GPT or Llama); `parts` as Decoder takes them (a
    pipeline stage's layers, embeddings, head; the seed)."""
    return FAMILIES[config.family](config, **parts)


def parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """{name: full shape} of every parameter of the model of `config` (a tied head once, as
    named_parameters gives it), without memory: built on the meta device with one block, whose
    shapes every block repeats, so a model of 80 layers costs what one layer does (checks run
    before a model is built must not cost a build)."""
    with torch.device("meta"):
        model = build_model(config, layers=[0])
    shapes = {}
    for name, parameter in model.named_parameters():
        if name.startswith("layers.0."):
            for layer in range(config.n_layer):
                shapes[f"layers.{layer}.{name.removeprefix('layers.0.')}"] = tuple(parameter.shape)
        else:
            shapes[name] = tuple(parameter.shape)
    return shapes


__all__ = ["ARCHITECTURES", "Decoder", "GPT", "GPTConfig", "KVCache", "Llama", "PRESETS", "VOCABULARY_PARAMETERS",
           "build_model", "parameter_shapes", "vocabulary_rows"]
