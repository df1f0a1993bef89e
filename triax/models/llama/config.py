"""The llama family's model.* fields (checked and given Llama's values) and its presets."""

from __future__ import annotations

from triax.errors import ConfigError
from triax.models.config import GPTConfig, check_rotary

# Rotary frequency scalings: none (the original RoPE), linear (positions divided by rope_factor),
# llama3 (Llama 3.1's: low frequencies divided by rope_factor, high ones kept, smoothed between).
ROPE_SCALINGS = ("none", "linear", "llama3")


def swiglu_width(n_embd: int) -> int:
    """The llama family's default MLP width: 8/3 x n_embd (three matrices with the parameters of
    GPT's two of 4 x n_embd, as Llama chose), rounded up to a multiple of 32 for even kernels."""
    return -(-8 * n_embd // 3 // 32) * 32


# The architectures this family builds (transformers' model_type): they compute the same block, up
# to Qwen2's biases on the query/key/value projections and Qwen3's per-head q/k norms.
ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")

PRESETS: dict[str, dict] = {
    # A Llama small enough for a CPU: grouped-query attention (2 key/value heads for 4 query heads).
    "llama-debug": dict(arch="llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352),
    # Llama 3.1's published shapes (for `triax plan`; 128,256 tokens, rope_theta 500000, llama3 scaling).
    "llama3-8b": dict(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                      rope_theta=500000.0, rope_scaling="llama3", vocab_size=128256),
    "llama3-70b": dict(arch="llama", n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672,
                       rope_theta=500000.0, rope_scaling="llama3", vocab_size=128256),
    # Qwen3 (q/k norm per head): CPU-sized, then Qwen3-0.6B's published shape.
    "qwen3-debug": dict(arch="qwen3", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352),
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_dim=128,
                       intermediate_size=3072, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                       vocab_size=151936),
}
# Architectures with biases on the query/key/value projections whatever model.bias says.
QKV_BIAS_ARCHITECTURES = ("qwen2",)
# Architectures with an RMSNorm over each query and key head (by default).
QK_NORM_ARCHITECTURES = ("qwen3",)


def check_heads(config: GPTConfig) -> None:
    """Grouped-query attention's heads with rotary positions: n_kv_head divides n_head (unset: one
    key/value head per query head), head_dim (unset: n_embd / n_head) even; shared with every family
    whose attention is this one's."""
    config.n_kv_head = config.n_head if config.n_kv_head is None else config.n_kv_head
    if config.n_head % config.n_kv_head != 0:
        raise ConfigError(f"model.n_kv_head={config.n_kv_head} does not divide model.n_head={config.n_head}; each "
                          "key/value head serves a whole group of query heads: choose a divisor of n_head")
    if config.head_dim is None:
        if config.n_embd % config.n_head != 0:
            raise ConfigError(f"model.n_embd={config.n_embd} is not divisible by model.n_head={config.n_head}; "
                              "choose n_embd as a multiple of n_head, or set model.head_dim")
        config.head_dim = config.n_embd // config.n_head
    if config.head_dim % 2:
        raise ConfigError(f"model.head_dim={config.head_dim} is odd; rotary positions rotate pairs of values, "
                          "so a head needs an even width")


def check_attention(config: GPTConfig, scalings: tuple[str, ...] = ROPE_SCALINGS) -> None:
    """The Llama block's fields (grouped-query attention, rotary positions, SwiGLU), unset ones given
    Llama's values; shared with the families built on this block, each naming the rotary scalings
    it computes."""
    check_heads(config)
    config.intermediate_size = config.intermediate_size or swiglu_width(config.n_embd)
    if config.bias is None:
        config.bias = False
    if config.bias and config.arch != "llama":
        raise ConfigError(f"model.bias=true with model.arch={config.arch}: transformers' {config.arch} has no such "
                          "option" + (" (its biases are on q/k/v only, always)" if config.arch == "qwen2" else "")
                          + "; use model.arch=llama for biases in every linear layer")
    if config.gelu != "tanh":
        raise ConfigError(f"model.gelu={config.gelu!r} applies to model.arch=gpt2; the llama family's MLP is SwiGLU "
                          "(SiLU), which has no choice of form")
    check_rotary(config, scalings)


def check(config: GPTConfig) -> None:
    """The llama family's fields: the block's, Qwen3's q/k norm default."""
    check_attention(config)
    if config.qk_norm is None:
        config.qk_norm = config.arch in QK_NORM_ARCHITECTURES
