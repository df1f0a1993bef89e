"""GPT-2's blocks (the minGPT/GPT-2 architecture): learned positions, pre-LayerNorm blocks, a GELU
MLP and full multi-head attention. The skeleton they sit in (embeddings, head, initialisation,
cache, generation) is triax/models/decoder.py, shared with the llama family."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.models.config import GELU_FORMS, MAX_SIZES, PRESETS, SIZE_REASON, GPTConfig
from triax.models.decoder import Block, Decoder, KVCache, LayerCache, PaddedVocabMask, causal_attention

__all__ = ["GPT", "GPTConfig", "KVCache", "LayerCache", "PaddedVocabMask", "PRESETS", "MAX_SIZES", "SIZE_REASON",
           "GELU_FORMS"]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        # Separate q/k/v projections (rather than one fused c_attn) so a tensor-parallel plan can
        # shard each by heads with a plain column-parallel split.
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.out_proj.residual_projection = True  # marks it for the GPT-2 scaled init
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head count: under tensor parallelism this rank holds only some heads.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        y = causal_attention(q, k, v, cache, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.out_proj(y))

    @property
    def head_dim(self) -> int:
        return self.q_proj.in_features // self.n_head


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

    family = "gpt"
    learned_positions = True

    def make_block(self, config: GPTConfig) -> nn.Module:
        return Block(self.make_norm(config), CausalSelfAttention(config), self.make_norm(config), MLP(config))

    def make_norm(self, config: GPTConfig) -> nn.Module:
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
