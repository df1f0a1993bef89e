"""GPT-2's blocks (the minGPT/GPT-2 architecture): learned positions, pre-LayerNorm blocks, a GELU
MLP and full multi-head attention. The skeleton they sit in (embeddings, head, initialisation,
cache, generation) is triax/models/decoder.py, shared with every family."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.models.config import GPTConfig
from triax.models.decoder import Block, Decoder, SelfAttention
from triax.models.gpt2.config import GELU_FORMS


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)
        self.down_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = GELU_FORMS[config.gelu]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate)))


class GPT(Decoder):
    """GPT-2: token + learned position embeddings, LayerNorm blocks with a GELU MLP.
    See Decoder for the arguments (a pipeline stage's parts, the seed)."""

    family = "gpt2"
    attends_by_mask = True
    learned_positions = True

    def make_block(self, config: GPTConfig, layer: int = 0) -> nn.Module:
        return Block(self.make_norm(config), SelfAttention(config), self.make_norm(config), MLP(config))

    def make_norm(self, config: GPTConfig) -> nn.Module:
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)

