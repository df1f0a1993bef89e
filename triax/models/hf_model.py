"""A whole plain model built from a transformers checkpoint directory (GPT-2 or the llama family),
for the commands that score or answer with one (`triax eval`, `triax generate --chat`)."""

from __future__ import annotations

import torch

from triax.models import GPTConfig, build_model, hf


def load_hf_model(directory: str, device: torch.device, dropout: float = 0.0):
    """A whole plain model holding a transformers checkpoint's weights."""
    config = GPTConfig(**hf.architecture(directory), dropout=dropout)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    hf.load_into(model, directory, config)
    return model.eval()
