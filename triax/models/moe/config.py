"""The mixture-of-experts family's model.* fields: the Llama block's, then the experts' (sizes,
routing, which layers have them), and its presets."""

from __future__ import annotations

from triax.errors import ConfigError
from triax.models.config import MAX_OPTIONAL_SIZES, MAX_SIZES, GPTConfig, check_size
from triax.models.llama.config import ROPE_SCALINGS, check_attention

# The architectures this family builds (transformers' model_type).
ARCHITECTURES = ("mixtral", "qwen3_moe")
MAX_EXPERTS = 2**14  # published MoEs route over at most a few hundred experts
# The optional mechanisms (triax.models.config.MECHANISMS) this family computes: the experts' fields.
HONOURS = frozenset({"num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
                     "router_scoring", "router_bias_update_rate", "shared_expert_intermediate_size",
                     "shared_expert_gate", "decoder_sparse_step", "mlp_only_layers"})

# CPU-sized, then the published shapes (Mixtral 8x7B, Qwen3-30B-A3B: 128 experts, 8 per token).
PRESETS: dict[str, dict] = {
    "mixtral-debug": dict(arch="mixtral", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352,
                          num_experts=8, experts_per_token=2),
    "mixtral-8x7b": dict(arch="mixtral", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                         num_experts=8, experts_per_token=2, rope_theta=1000000.0, vocab_size=32000),
    "qwen3-moe-debug": dict(arch="qwen3_moe", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352,
                            moe_intermediate_size=64, num_experts=8, experts_per_token=2, norm_topk_prob=True),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, experts_per_token=8,
                          norm_topk_prob=True, rope_theta=1000000.0, norm_eps=1e-6, vocab_size=151936),
}


def check(config: GPTConfig, scalings: tuple[str, ...] = ROPE_SCALINGS) -> None:
    """The Llama block's fields (for a family whose rotary positions scale in one of `scalings`),
    then the experts': sizes, routing, which layers have them."""
    check_attention(config, scalings)
    if config.qk_norm is None:
        config.qk_norm = config.arch == "qwen3_moe"
    check_size("num_experts", config.num_experts, MAX_EXPERTS)
    check_size("experts_per_token", config.experts_per_token, MAX_EXPERTS)
    if config.experts_per_token > config.num_experts:
        raise ConfigError(f"model.experts_per_token={config.experts_per_token} is above model.num_experts="
                          f"{config.num_experts}; a token cannot be routed to more experts than there are")
    if config.moe_intermediate_size == 0:  # not unset: a width of zero, which no expert can have
        raise ConfigError("model.moe_intermediate_size=0: an expert's MLP width must be positive (leave it unset "
                          "for model.intermediate_size)")
    config.moe_intermediate_size = config.moe_intermediate_size or config.intermediate_size
    check_size("moe_intermediate_size", config.moe_intermediate_size, MAX_OPTIONAL_SIZES["intermediate_size"])
    if config.norm_topk_prob is None:
        config.norm_topk_prob = config.arch == "mixtral"
    if config.arch == "mixtral" and not config.norm_topk_prob:
        raise ConfigError("model.norm_topk_prob=false with model.arch=mixtral: Mixtral always renormalises its "
                          "top-k weights; use model.arch=qwen3_moe for unnormalised weights")
    _check_router(config)
    _check_layers(config)


def _check_router(config: GPTConfig) -> None:
    if config.router_scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.router_scoring={config.router_scoring!r} is unknown; choose softmax or sigmoid")
    if not (isinstance(config.router_bias_update_rate, (int, float)) and 0 <= config.router_bias_update_rate < 1):
        raise ConfigError(f"model.router_bias_update_rate={config.router_bias_update_rate!r} must be in [0, 1) "
                          "(0: no bias; DeepSeek-V3 used 0.001)")
    if config.arch == "mixtral" and config.router_scoring != "softmax":
        raise ConfigError("model.router_scoring=sigmoid with model.arch=mixtral: Mixtral's router is a softmax; "
                          "use model.arch=qwen3_moe for DeepSeek-V3's sigmoid scores")
    if config.shared_expert_intermediate_size:
        check_size("shared_expert_intermediate_size", config.shared_expert_intermediate_size,
                   MAX_OPTIONAL_SIZES["intermediate_size"])
    if config.shared_expert_gate and not config.shared_expert_intermediate_size:
        raise ConfigError("model.shared_expert_gate=true without a shared expert; set "
                          "model.shared_expert_intermediate_size > 0")


def _check_layers(config: GPTConfig) -> None:
    check_size("decoder_sparse_step", config.decoder_sparse_step, MAX_SIZES["n_layer"])
    config.mlp_only_layers = list(config.mlp_only_layers or [])
    bad = [i for i in config.mlp_only_layers if type(i) is not int or not 0 <= i < config.n_layer]
    if bad:
        raise ConfigError(f"model.mlp_only_layers holds {bad[0]!r}, not a layer number below "
                          f"n_layer={config.n_layer}")
    if config.arch == "mixtral" and (config.mlp_only_layers or config.decoder_sparse_step != 1):
        raise ConfigError("model.mlp_only_layers / decoder_sparse_step are qwen3_moe's; Mixtral has experts in "
                          "every layer: use model.arch=qwen3_moe")
