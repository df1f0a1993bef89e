"""A whole plain model built from a transformers checkpoint directory (GPT-2 or the llama family),
for the commands that score or answer with one (`triax eval`, `triax generate --chat`)."""

from __future__ import annotations

import os

import torch

from triax.models import GPTConfig, build_model
from triax.interop.hf import directory as hf
from triax.models.memory import check_whole_model_fits
from triax.runtime.place import detect_place


def load_hf_model(directory: str, device: torch.device, dropout: float = 0.0):
    """A whole plain model holding a transformers checkpoint's weights."""
    stored = hf.read_hf_config(directory)  # config.json, read once
    config = GPTConfig(**hf.architecture(directory, stored), dropout=dropout)
    # From the config and the safetensors headers alone, before anything is allocated; every
    # process of this host (torchrun's LOCAL_WORLD_SIZE) loads a whole copy.
    check_whole_model_fits(config, device, os.path.join(directory, "config.json"), detect_place().local_world_size)
    hf.check_weights(directory, config, stored)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    hf.load_into(model, directory, config, config=stored)
    return model.eval()
