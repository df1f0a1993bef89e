"""GPT-2's model.* fields (checked and given GPT-2's values) and its presets."""

from __future__ import annotations

from triax.errors import ConfigError
from triax.models.config import GPTConfig

# model.gelu -> F.gelu's `approximate` argument.
GELU_FORMS = {"tanh": "tanh", "exact": "none"}

# The architectures this family builds (transformers' model_type).
ARCHITECTURES = ("gpt2",)

# GPT-2's and minGPT's shapes (model.arch unset: gpt2, GPTConfig's default).
PRESETS: dict[str, dict] = {
    "openai-gpt": dict(n_layer=12, n_head=12, n_embd=768),   # 117M
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),         # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),     # 1558M
    "gopher-44m": dict(n_layer=8, n_head=16, n_embd=512),
    "gpt-mini": dict(n_layer=6, n_head=6, n_embd=192),
    "gpt-micro": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt-nano": dict(n_layer=3, n_head=3, n_embd=48),
}

# The rotary fields' defaults, which GPT-2 (learned positions) must keep.
_ROTARY_DEFAULTS = {"rope_theta": 10000.0, "rope_scaling": "none", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
                    "rope_high_freq_factor": 4.0, "rope_original_context": 8192}


def check(config: GPTConfig) -> None:
    """GPT-2's fields: full multi-head attention, learned positions; unset ones get GPT-2's values."""
    if config.n_embd % config.n_head != 0:
        raise ConfigError(f"model.n_embd={config.n_embd} is not divisible by model.n_head={config.n_head}; "
                          f"choose n_embd as a multiple of n_head")
    config.n_kv_head = config.n_head if config.n_kv_head is None else config.n_kv_head
    config.head_dim = config.n_embd // config.n_head if config.head_dim is None else config.head_dim
    config.intermediate_size = config.intermediate_size or 4 * config.n_embd
    config.bias = True if config.bias is None else config.bias
    if config.n_kv_head != config.n_head or config.head_dim != config.n_embd // config.n_head:
        raise ConfigError(f"model.arch=gpt2 has one key/value head per query head of n_embd / n_head values "
                          f"(got n_kv_head={config.n_kv_head}, head_dim={config.head_dim}); leave them unset, or use "
                          f"model.arch=llama for grouped-query attention")
    changed = [name for name, default in _ROTARY_DEFAULTS.items() if getattr(config, name) != default]
    if changed:
        raise ConfigError(f"model.{changed[0]}={getattr(config, changed[0])!r} applies to rotary positions, which "
                          f"model.arch=gpt2 does not have (it learns its positions); use model.arch=llama")
    if config.gelu not in GELU_FORMS:
        raise ConfigError(f"model.gelu={config.gelu!r} must be one of {', '.join(GELU_FORMS)}")
    if config.qk_norm:
        raise ConfigError("model.qk_norm=true applies to the llama family's attention; use model.arch=qwen3")
    config.qk_norm = False
