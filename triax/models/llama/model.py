"""The Llama family's blocks (Llama 2/3, Qwen2, Mistral, SmolLM, TinyLlama...): rotary position
embeddings, RMSNorm, a SwiGLU MLP and grouped-query attention, in the skeleton of
triax/models/decoder.py (shared with GPT-2).

Rotary embeddings follow transformers' convention (rotate_half: the two halves of each head are
the pairs that rotate together), so transformers' weights are used as they are. Meta's and
torchtitan's checkpoints pair neighbouring values instead; their rows of q and k are permuted
when read (triax/interop/meta/weights.py). The frequencies and their cos/sin are computed in fp32 whatever the
compute dtype, as in the original; the rotation runs in fp32 too and returns the input's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.models.config import GPTConfig
from triax.models.decoder import Block, Decoder, SelfAttention


def inverse_frequencies(config: GPTConfig, dim: int | None = None) -> torch.Tensor:
    """theta^(-2i/d) for each pair i of a head of d values (`dim`, unset: head_dim), with the
    configured scaling (fp32, CPU)."""
    dim = dim or config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inverse = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling == "linear":
        return inverse / config.rope_factor
    if config.rope_scaling == "llama3":
        # Llama 3.1: wavelengths longer than the pre-training context / low_freq_factor are
        # stretched by `factor`, those shorter than context / high_freq_factor kept, and the ones
        # between interpolated smoothly.
        context, low, high = config.rope_original_context, config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelength = 2 * math.pi / inverse
        scaled = torch.where(wavelength > context / low, inverse / config.rope_factor, inverse)
        smooth = (context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / config.rope_factor + smooth * scaled
        between = ~(wavelength < context / high) * ~(wavelength > context / low)
        return torch.where(between, smoothed, scaled)
    return inverse


class RotaryEmbedding:
    """The cos/sin tables of positions past .. past + seq, shared by every attention layer of a
    model (a plain object, not a module: it holds no state to save, shard or initialise). The last
    tables are kept: in training every step and every layer asks for the same positions, so they
    are computed once per model instead of once per layer and step."""

    def __init__(self, config: GPTConfig, dim: int | None = None):
        """`dim`: the values of a head that rotate, when not all of head_dim (latent attention's)."""
        self.inverse = inverse_frequencies(config, dim)
        self._last: tuple | None = None
        self._given: tuple | None = None  # (positions, their tables) of the last forward given positions

    def __call__(self, q: torch.Tensor, k: torch.Tensor, past: int,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (batch, heads, seq, head size) of the positions after `past`, rotated;
        `positions` (batch, seq): each token's own position instead (packed examples); (seq,): the
        same positions for every row (a context-parallel rank's part of the sequence)."""
        if positions is not None:
            cos, signed_sin = self.tables_of(positions)
            if positions.dim() == 2:
                cos, signed_sin = cos[:, None], signed_sin[:, None]  # one table per row, for every head
        else:
            cos, signed_sin = self.tables(past, q.size(2), q.device)
        return rotate(q, cos, signed_sin), rotate(k, cos, signed_sin)

    def tables_of(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of given positions; every layer of a forward is given the same tensor, whose
        tables are kept (the tensor with them: the same object is the same positions)."""
        if torch.compiler.is_compiling():
            return self._angles(positions.float())
        mode = torch.is_inference_mode_enabled()  # inference tensors may not be saved for a backward
        if self._given is None or self._given[0] is not positions or self._given[1] != mode:
            self._given = (positions, mode, self._angles(positions.float()))
        return self._given[2]

    def tables(self, past: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # inside a compiled graph: computed there, fused, kept by nothing
            return self._compute(past, seq, device)
        key = (past, seq, device, torch.is_inference_mode_enabled())
        if self._last is None or self._last[0] != key:
            self._last = (key, self._compute(past, seq, device))
        return self._last[1]

    def _compute(self, past: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) of each position's angles, (seq, head size): the sin of the first half
        negated, which is the sign `rotate` needs (a table computed once instead of a negation of
        q and k in every layer, forward and backward)."""
        return self._angles(torch.arange(past, past + seq, device=device, dtype=torch.float32))

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None] * self.inverse.to(positions.device)
        return torch.cat((angles, angles), dim=-1).cos(), torch.cat((-angles.sin(), angles.sin()), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (batch, heads, seq, head size): each value i of a head's first half
    turns with value i of its second half by its position's angle a, (x1, x2) -> (x1 cos a - x2
    sin a, x2 cos a + x1 sin a): transformers' x * cos + rotate_half(x) * sin, exactly."""
    values = x.float()
    half = values.size(-1) // 2
    swapped = torch.cat((values[..., half:], values[..., :half]), dim=-1)
    return (values * cos + swapped * signed_sin).to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, config: GPTConfig, width: int | None = None):
        super().__init__()
        width = width or config.intermediate_size  # another width: a mixture of experts' shared expert
        self.gate_proj = nn.Linear(config.n_embd, width, bias=config.bias)
        self.up_proj = nn.Linear(config.n_embd, width, bias=config.bias)
        self.down_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.down_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Llama(Decoder):
    """The llama family (model.arch=llama | qwen2 | mistral): token embedding only (positions are
    rotary, inside attention), RMSNorm blocks with grouped-query attention and a SwiGLU MLP.
    See Decoder for the arguments (a pipeline stage's parts, the seed)."""

    family = "llama"
    attends_by_mask = True

    def make_block(self, config: GPTConfig, layer: int = 0) -> nn.Module:
        if "rotary" not in self.__dict__:  # one table for all layers (built with the first)
            self.rotary = RotaryEmbedding(config)
        return Block(self.make_norm(config), SelfAttention(config, self.rotary), self.make_norm(config),
                     SwiGLU(config))

    def make_norm(self, config: GPTConfig) -> nn.Module:
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)

