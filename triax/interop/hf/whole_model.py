"""A whole plain model built from a transformers checkpoint directory (GPT-2 or the llama family),
for the commands that score or answer with one (`triax eval`, `triax generate --chat`): the
directory read through its ForeignRun (triax/interop/hf/directory.py's HFDirectory), its size checked
against this host before its weights are opened."""

from __future__ import annotations

import torch

from triax.interop.hf.directory import HFDirectory


def load_hf_model(directory: str, device: torch.device, dropout: float = 0.0) -> torch.nn.Module:
    """A whole plain model holding a transformers checkpoint's weights."""
    return HFDirectory(directory, None, whole_on=device).whole_model(device, dropout)
