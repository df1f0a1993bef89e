"""Building a model of any registered family from its config, and its parameters' shapes without
building it (triax.models re-exports both)."""

from __future__ import annotations

import torch

from triax.models.config import GPTConfig
from triax.models.decoder import Decoder
from triax.models.family import spec_of


def build_model(config: GPTConfig, **parts) -> Decoder:
    """The model of `config`'s architecture (its family's Decoder); `parts` as Decoder takes them (a
    pipeline stage's layers, embeddings, head; the seed)."""
    return spec_of(config.arch).model(config, **parts)


def parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """{name: full shape} of every parameter of the model of `config` (a tied head once, as
    named_parameters gives it), without memory: built on the meta device with one block of each
    kind (a mixture of experts may have dense layers too), whose shapes every block of that kind
    repeats, so a model of 80 layers costs what one layer does (checks run before a model is built
    must not cost a build)."""
    kind = [config.has_experts(layer) for layer in range(config.n_layer)]
    first = {has: kind.index(has) for has in set(kind)}  # the first layer of each kind
    with torch.device("meta"):
        model = build_model(config, layers=sorted(first.values()))
    before, layers, after = {}, {layer: {} for layer in range(config.n_layer)}, {}
    for name, parameter in model.named_parameters():
        if not name.startswith("layers."):
            # named_parameters' order: the embedding, the layers, the final norm and head.
            (after if any(layers.values()) else before)[name] = tuple(parameter.shape)
            continue
        built, rest = name.removeprefix("layers.").split(".", 1)
        for layer in range(config.n_layer):
            if first[kind[layer]] == int(built):
                layers[layer][f"layers.{layer}.{rest}"] = tuple(parameter.shape)
    return {**before, **{k: v for layer in layers.values() for k, v in layer.items()}, **after}
