"""Phi-3's model.* fields (the llama block's, with no rotary scaling: transformers' Phi-3 has only
LongRoPE, which triax does not compute) and its presets."""

from __future__ import annotations

from triax.models.config import GPTConfig
from triax.models.llama.config import check_attention

ARCHITECTURES = ("phi3",)

PRESETS: dict[str, dict] = {
    # A Phi-3 small enough for a CPU: grouped-query attention (2 key/value heads for 4 query heads).
    "phi3-debug": dict(arch="phi3", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352,
                       norm_eps=1e-5),
    # Phi-4 (14B)'s published config.json (for `triax plan`): 100,352 tokens, rope_theta 250,000, no window.
    "phi-4": dict(arch="phi3", n_layer=40, n_head=40, n_kv_head=10, n_embd=5120, intermediate_size=17920,
                  rope_theta=250000.0, norm_eps=1e-5, vocab_size=100352),
}


def check(config: GPTConfig) -> None:
    """The llama block's fields with unscaled rotary positions; no per-head q/k norm by default."""
    check_attention(config, ("none",))
    if config.qk_norm is None:
        config.qk_norm = False
