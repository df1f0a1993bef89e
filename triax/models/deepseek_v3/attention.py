"""Multi-head latent attention (DeepSeek-V2/V3): queries, keys and values come from low-rank
latents, and a generation cache keeps only the key/value latent and the rotary key.

Per token: the queries are q_proj(x), or q_b_proj(norm(q_a_proj(x))) through a latent of
q_lora_rank values; kv_a_proj_with_mqa(x) gives the key/value latent (kv_lora_rank values,
normalised) and one rotary key of qk_rope_head_dim values shared by every head; kv_b_proj turns
the latent into each head's key without positions (qk_nope_head_dim) and its value (v_head_dim).
A head's key is [its positionless key, the shared rotary key], its query likewise.

The rotary values pair neighbours ((x0, x1), (x2, x3)...: DeepSeek's layout, transformers'
rope_interleave=true). They are rearranged into halves (evens, then odds) before the rotation of
triax/models/llama.py, which pairs value i with value i + d/2: the same pairs turned by the same
angles, in another order, which no dot product of a query with a key sees.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.models.config import GPTConfig
from triax.models.decoder import LayerCache, Packed, causal_attention
from triax.models.llama import RotaryEmbedding

# transformers' DeepseekV3RMSNorm over the latents keeps its own epsilon (not rms_norm_eps).
LATENT_NORM_EPS = 1e-6


def halves(x: torch.Tensor) -> torch.Tensor:
    """Neighbouring pairs (x0, x1), (x2, x3)... laid out as halves: x0, x2, ..., x1, x3, ..."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention. The module names are transformers' (out_proj: o_proj)."""

    def __init__(self, config: GPTConfig, rotary: RotaryEmbedding, softmax_factor: float = 1.0):
        """`softmax_factor`: multiplies the softmax scale 1/sqrt(qk head width) (YaRN's mscale squared)."""
        super().__init__()
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        heads, qk_dim = config.n_head, config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(config.n_embd, config.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(config.n_embd, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.n_embd, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.out_proj = nn.Linear(heads * self.v_dim, config.n_embd, bias=False)
        self.out_proj.residual_projection = True  # marks it for the scaled init
        # Where the rotary key, computed by every tensor-parallel rank alike, becomes this rank's heads'
        # alone (parallel.py's plan marks it; otherwise nothing).
        self.rope_key = nn.Identity()
        self.rotary = rotary
        self.softmax_factor = softmax_factor
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, packed: Packed | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the heads: under tensor parallelism this rank holds only some of them.
        q = self.queries(x).view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # (batch, 1, seq, kv_rank): one "head", as cached
        past = cache.length if cache is not None else 0
        k_rope = self.rope_key(k_rope).unsqueeze(1)
        q_rope, k_rope = self.rotary(halves(q_rope), halves(k_rope), past,
                                     packed.positions if packed is not None else None)
        if cache is not None:  # the cache keeps the latent and the rotary key only
            latent, k_rope = cache.append(latent, k_rope)
        keys_values = self.kv_b_proj(latent).view(batch, latent.size(2), -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = keys_values.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.size(1), -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        y = attend(q, k, v, past, self.dropout if self.training else 0.0, packed)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.out_proj(y))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, dropout: float,
           packed: Packed | None) -> torch.Tensor:
    """Causal attention of the queries after `past` cached positions over every key so far (the
    cache was appended already, so decoder.causal_attention's own appending is not used)."""
    if not past:
        return causal_attention(q, k, v, None, dropout, packed)
    seq = q.size(2)
    mask = torch.ones(seq, past + seq, dtype=torch.bool, device=q.device).tril(diagonal=past) if seq > 1 else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
