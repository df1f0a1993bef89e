"""gpt-oss's model.* fields checked and given their defaults (what GPTConfig.__post_init__ calls
for model.arch=gpt_oss), and its presets.

Defaults are transformers' GptOssConfig's where a field is unset: sinks on, the clamped SwiGLU at
7.0, biases on the attention projections, layers alternating sliding and full attention when a
window is set, the top-k weights renormalised (Mixtral's routing, which gpt-oss's is).
"""

from __future__ import annotations

from triax.errors import ConfigError
from triax.models.config import MAX_OPTIONAL_SIZES, MAX_SIZES, GPTConfig, check_rotary, check_size
from triax.models.gpt_oss.model import FULL, SLIDING
from triax.models.llama.config import check_heads

ARCH = "gpt_oss"
ARCHITECTURES = (ARCH,)
MAX_EXPERTS = 2**14  # the released models route over 32 and 128
ROPE_SCALINGS = ("none", "yarn")
# The optional mechanisms (triax.models.config.MECHANISMS) this family computes: sinks, windows, the
# clamped SwiGLU, YaRN's rotary scaling, and experts in every layer, softmax-scored, without shared
# ones (so GPTConfig refuses router_scoring, router_bias_update_rate, the shared expert's fields and
# decoder_sparse_step for it; mlp_only_layers is checked here: its check writes [] for it).
HONOURS = frozenset({"attention_sinks", "sliding_window", "layer_types", "swiglu_limit", "swiglu_alpha",
                     "rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_attention_factor", "num_experts",
                     "experts_per_token", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"})

# The published shapes (for `triax plan`; 201,088 tokens, YaRN x32 over a 4,096-token pre-training
# context, a 128-token window on every other layer), and one small enough for a CPU.
_SHAPE = dict(arch=ARCH, n_head=64, n_kv_head=8, head_dim=64, n_embd=2880, intermediate_size=2880,
              experts_per_token=4, sliding_window=128, rope_theta=150000.0, rope_scaling="yarn", rope_factor=32.0,
              rope_original_context=4096, rope_truncate=False, vocab_size=201088)
PRESETS: dict[str, dict] = {
    "gpt-oss-debug": dict(arch=ARCH, n_layer=4, n_head=4, n_kv_head=2, head_dim=32, n_embd=128,
                          intermediate_size=128, num_experts=8, experts_per_token=2, sliding_window=16),
    "gpt-oss-20b": dict(_SHAPE, n_layer=24, num_experts=32),
    "gpt-oss-120b": dict(_SHAPE, n_layer=36, num_experts=128),
}


def check(config: GPTConfig) -> None:
    """Validates gpt-oss's fields and fills the unset ones (see the module's docstring)."""
    _check_attention(config)
    check_rotary(config, ROPE_SCALINGS)
    _check_experts(config)


def _check_attention(config: GPTConfig) -> None:
    check_heads(config)  # the llama family's attention heads, with sinks and windows added below
    config.bias = True if config.bias is None else config.bias
    config.attention_sinks = True if config.attention_sinks is None else config.attention_sinks
    if config.gelu != "tanh" or config.qk_norm:
        raise ConfigError(f"model.gelu / model.qk_norm with model.arch={ARCH}: its experts' activation is the "
                          "clamped SwiGLU and it has no q/k norms; leave them unset")
    config.qk_norm = False
    window = config.sliding_window
    if window is not None:
        check_size("sliding_window", window, MAX_SIZES["block_size"])
    if config.layer_types is None:
        config.layer_types = [SLIDING if window is not None and layer % 2 == 0 else FULL
                              for layer in range(config.n_layer)]
    config.layer_types = list(config.layer_types)
    if len(config.layer_types) != config.n_layer or any(kind not in (SLIDING, FULL) for kind in config.layer_types):
        raise ConfigError(f"model.layer_types={config.layer_types!r} must name {SLIDING} or {FULL} for each of the "
                          f"n_layer={config.n_layer} layers")
    if window is None and SLIDING in config.layer_types:
        raise ConfigError(f"model.layer_types names {SLIDING} layers but model.sliding_window is unset; set the "
                          "window's length")


def _check_experts(config: GPTConfig) -> None:
    config.intermediate_size = config.intermediate_size or 4 * config.n_embd
    check_size("num_experts", config.num_experts, MAX_EXPERTS)
    if not 1 <= config.experts_per_token <= config.num_experts:
        raise ConfigError(f"model.experts_per_token={config.experts_per_token} must be between 1 and "
                          f"model.num_experts={config.num_experts}")
    config.moe_intermediate_size = config.moe_intermediate_size or config.intermediate_size
    check_size("moe_intermediate_size", config.moe_intermediate_size, MAX_OPTIONAL_SIZES["intermediate_size"])
    if config.norm_topk_prob is False:
        raise ConfigError(f"model.norm_topk_prob=false with model.arch={ARCH}: its routing weights are a softmax "
                          "over the chosen experts' logits, which sum to one")
    config.norm_topk_prob = True
    config.swiglu_limit = 7.0 if config.swiglu_limit is None else config.swiglu_limit
    if not (isinstance(config.swiglu_limit, (int, float)) and config.swiglu_limit > 0):
        raise ConfigError(f"model.swiglu_limit={config.swiglu_limit!r} must be a positive number (7.0 as released)")
    if not (isinstance(config.swiglu_alpha, (int, float)) and config.swiglu_alpha > 0):
        raise ConfigError(f"model.swiglu_alpha={config.swiglu_alpha!r} must be a positive number (1.702 as released)")
    if config.mlp_only_layers:
        raise ConfigError(f"model.mlp_only_layers={config.mlp_only_layers!r} with model.arch={ARCH}: its every layer "
                          "routes experts; leave it unset")
    config.mlp_only_layers = []
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = getattr(config, name)
        if not (isinstance(value, (int, float)) and 0 <= value < 1e3):
            raise ConfigError(f"model.{name}={value!r} must be a number in [0, 1000) (0 turns it off)")
