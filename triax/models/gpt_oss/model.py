"""gpt-oss's blocks (model.arch=gpt_oss): the mixture-of-experts decoder of triax/models/moe/ with
four changes, each computed as transformers' GptOssForCausalLM computes it:

- attention sinks: each head has a learned logit that joins every softmax's denominator (a
  column of the attention weights whose value is zero), so a query may give its probability to
  nothing instead of spreading it over the keys;
- sliding windows: the layers config.layer_types names `sliding_attention` see only the last
  `sliding_window` keys (themselves included), in training and through generation's cache;
- experts with biases (router, and each expert's three projections) and a clamped SwiGLU:
  gate <= limit, -limit <= up <= limit, out = (up + 1) * gate * sigmoid(alpha * gate);
- YaRN rotary scaling: frequencies interpolated between the original and the factor-stretched
  ones by a ramp over the rotary dimensions, and cos/sin scaled by an attention factor.

Routing is a softmax over the top-k router logits (the renormalised top-k of Mixtral's softmax over
all of them, computed as transformers' gpt-oss computes it: see BiasedMoE), and expert parallelism
exchanges tokens as for any mixture (triax/models/experts.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.models.config import GPTConfig
from triax.models.decoder import Block, LayerCache, Packed, SelfAttention
from triax.models.init import init_constant, init_normal
from triax.models.experts import GroupedExperts, MoE, _local, grouped_linear
from triax.models.llama import RotaryEmbedding, inverse_frequencies
from triax.models.moe.model import Mixture
from triax.models.rotary import mscale, yarn_inverse_frequencies

SLIDING, FULL = "sliding_attention", "full_attention"


def yarn_frequencies(config: GPTConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin gain) of YaRN over a whole head (triax/models/rotary.py); the
    gain is rope_attention_factor, unset = 0.1 ln(rope_factor) + 1."""
    gain = config.rope_attention_factor
    gain = mscale(config.rope_factor) if gain is None else gain
    return yarn_inverse_frequencies(config, config.head_dim), float(gain)


class ScaledRotary(RotaryEmbedding):
    """The llama family's rotary tables, with YaRN's frequencies and gain when rope_scaling=yarn."""

    def __init__(self, config: GPTConfig):
        if config.rope_scaling == "yarn":
            self.inverse, self.gain = yarn_frequencies(config)
        else:
            self.inverse, self.gain = inverse_frequencies(config), 1.0
        self._last = self._given = None

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, signed_sin = super()._angles(positions)
        if self.gain == 1.0:
            return cos, signed_sin
        return cos * self.gain, signed_sin * self.gain


def window_of(config: GPTConfig, layer: int) -> int | None:
    """Layer `layer`'s sliding window (None: it attends to the whole context)."""
    return config.sliding_window if config.layer_types[layer] == SLIDING else None


def visible_keys(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(queries, keys) bool: the queries, the last `queries` of the `keys` positions, see
    themselves and the keys before them, at most `window` of them (None: all)."""
    query_at = torch.arange(keys - queries, keys, device=device)[:, None]
    key_at = torch.arange(keys, device=device)[None, :]
    visible = key_at <= query_at
    if window is not None:
        visible = visible & (query_at - key_at < window)
    return visible


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                   sinks: torch.Tensor | None, dropout: float) -> torch.Tensor:
    """Attention of q over the keys `visible` (broadcast to (batch, heads, queries, keys)) marks,
    with each head's sink logit in the softmax's denominator: one more key, of zeros (its score is
    then the additive mask alone: the sink), whose value is zeros. One fused call (kernels that
    take an additive mask also give its gradient: the sinks')."""
    grouped = k.size(1) != q.size(1)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, enable_gqa=grouped)
    if hasattr(sinks, "to_local"):  # tensor parallelism: this rank's heads' sinks
        sinks = sinks.to_local()
    visible = visible if visible.dim() == 4 else visible[None, None]
    batch, heads, queries, keys = q.size(0), q.size(1), q.size(2), k.size(2)
    scores = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    scores = scores.expand(visible.size(0), heads, queries, keys)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(scores.size(0), heads, queries, 1)
    mask = torch.cat((scores, sink), dim=-1)
    zero = k.new_zeros(batch, k.size(1), 1, k.size(3))
    k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=grouped)


class SinkAttention(SelfAttention):
    """SelfAttention (grouped-query heads, rotary positions, q/k/v/o biases when config.bias) whose
    softmax has a sink per head, over a sliding window of keys when `window` is set."""

    def __init__(self, config: GPTConfig, rotary: ScaledRotary, window: int | None):
        super().__init__(config, rotary)
        self.window = window
        self.sinks = nn.Parameter(torch.empty(config.n_head)) if config.attention_sinks else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None,
               packed: Packed | None) -> torch.Tensor:
        if packed is not None and not isinstance(packed, Packed):
            raise NotImplementedError("context parallelism of attention with sinks or a sliding window is not "
                                      "supported; use parallel.cp=1")
        if cache is not None:
            # A sliding layer keeps only the keys a later query can see: its last window - 1 (the
            # returned ones are the kept ones and the new: the mask counts from the first of them).
            k, v = cache.append(k, v, keep=None if self.window is None else self.window - 1)
        visible = visible_keys(q.size(2), k.size(2), self.window, q.device)
        if packed is not None:
            visible = packed.mask & visible  # (batch, 1, seq, seq): each example sees only itself
        return sink_attention(q, k, v, visible, self.sinks, self.dropout if self.training else 0.0)


class ClampedExperts(GroupedExperts):
    """GroupedExperts with a bias on each of the three projections ([experts, out] each, split with
    the weights by expert parallelism) and the clamped SwiGLU between them."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        experts, width, embd = config.num_experts, config.moe_intermediate_size, config.n_embd
        self.gate_proj_bias = nn.Parameter(torch.empty(experts, width))
        self.up_proj_bias = nn.Parameter(torch.empty(experts, width))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, embd))
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def local_forward(self, x: torch.Tensor, counts: torch.Tensor, weight_of=_local) -> torch.Tensor:
        gate, up, down = (weight_of(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        gate_bias, up_bias, down_bias = (weight_of(b) for b in (self.gate_proj_bias, self.up_proj_bias,
                                                                  self.down_proj_bias))
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
        gated = (grouped_linear(x, gate, counts) + gate_bias[expert]).clamp(max=self.limit)
        linear = (grouped_linear(x, up, counts) + up_bias[expert]).clamp(-self.limit, self.limit)
        hidden = (linear + 1) * gated * torch.sigmoid(self.alpha * gated)
        return grouped_linear(hidden, down, counts) + down_bias[expert]


class BiasedMoE(MoE):
    """MoE with a bias on the router's logits and ClampedExperts, routing in transformers'
    gpt-oss order: the top-k logits, then a softmax over them (in fp32)."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.gate = nn.Linear(config.n_embd, config.num_experts, bias=True)
        self.experts = ClampedExperts(config)

    def choose_experts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The same weights as the renormalised top-k of a softmax over every expert, but the experts
        # not chosen get no gradient at all, rather than a rounding error's, which AdamW would turn
        # into steps of the learning rate's size on their router rows.
        chosen, experts = torch.topk(logits.float(), self.top_k, dim=-1)
        return F.softmax(chosen, dim=-1), experts


class GptOss(Mixture):
    """gpt-oss: Mixture's skeleton with SinkAttention (a window on the layers config.layer_types
    names sliding), BiasedMoE in every layer and YaRN's rotary tables. See Decoder for the
    arguments (a pipeline stage's parts, the seed)."""

    family = "gpt_oss"

    def make_block(self, config: GPTConfig, layer: int = 0) -> nn.Module:
        if "rotary" not in self.__dict__:  # one table for all layers (built with the first)
            self.rotary = ScaledRotary(config)
        attention = SinkAttention(config, self.rotary, window_of(config, layer))
        return Block(self.make_norm(config), attention, self.make_norm(config), BiasedMoE(config))

    def init_weights(self, seed: int | None = None) -> None:
        """Mixture's initialisation; the experts' biases zero (as every Linear's), the sinks
        N(0, 0.02) (transformers' choice: a sink of zero would start every head alike)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        super().init_weights(seed)
        for name, module in self.named_modules():
            if isinstance(module, ClampedExperts):
                for bias in (module.gate_proj_bias, module.up_proj_bias, module.down_proj_bias):
                    init_constant(bias, 0.0)
            if isinstance(module, SinkAttention) and module.sinks is not None:
                init_normal(module.sinks, seed, f"{name}.sinks", 0.02)
