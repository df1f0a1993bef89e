"""model.arch=deepseek_v3's fields: checked, and their unset ones given DeepSeek-V3's values
(GPTConfig.__post_init__ calls `check` through the family's spec); the experts' fields are checked
as every mixture of experts' are (triax/models/moe/config.py)."""

from __future__ import annotations

from triax.errors import ConfigError
from triax.models.config import MAX_OPTIONAL_SIZES, GPTConfig, check_size, refuse_experts
from triax.models.llama.config import check_attention
from triax.models.moe import config as experts_config

# The rotary scalings this family computes: the llama block's (its RotaryEmbedding) and YaRN (yarn.py).
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
# transformers' DeepseekV3Config defaults for the head widths.
DEFAULT_WIDTHS = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64}
# The optional mechanisms (triax.models.config.MECHANISMS) this family computes: latent attention,
# group-limited routing, the routed scaling factor, leading dense layers, YaRN's rotary scaling, the
# experts' fields (its sinks, windows and clamped SwiGLU, which it has none of, are refused by
# GPTConfig for it).
HONOURS = frozenset({"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "router_groups", "router_topk_groups", "routed_scaling_factor", "first_dense_layers",
                     "rope_beta_fast", "rope_beta_slow", "rope_truncate", "rope_attention_factor"})
HONOURS |= experts_config.HONOURS
# Widths of a latent or a head: bounded as head_dim and the MLP widths are.
WIDTH_LIMIT = MAX_OPTIONAL_SIZES["intermediate_size"]


def check(config: GPTConfig) -> None:
    """Validates multi-head latent attention's fields and fills the unset ones."""
    if not config.kv_lora_rank:
        raise ConfigError("model.kv_lora_rank=0 with model.arch=deepseek_v3, whose attention reads keys and values "
                          "from a latent of that width: set it (DeepSeek-V3: 512)")
    for name, default in DEFAULT_WIDTHS.items():
        if getattr(config, name) is None:
            setattr(config, name, default)
    if config.v_head_dim is None:
        config.v_head_dim = config.qk_nope_head_dim
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") + (
            ("q_lora_rank",) if config.q_lora_rank is not None else ()):
        _width(name, getattr(config, name))
    if config.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={config.qk_rope_head_dim} is odd; rotary positions rotate pairs "
                          "of values: choose an even width")
    width = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.head_dim not in (None, width):
        raise ConfigError(f"model.head_dim={config.head_dim}: a latent attention head's query/key width is "
                          f"qk_nope_head_dim + qk_rope_head_dim = {width}; leave head_dim unset")
    config.head_dim = width
    if config.n_kv_head not in (None, config.n_head):
        raise ConfigError(f"model.n_kv_head={config.n_kv_head}: latent attention gives every query head its own "
                          "key and value (from the shared latent); leave n_kv_head unset")
    config.n_kv_head = config.n_head
    _check_mlp(config)
    if config.rope_scaling == "yarn":  # as DeepSeek-V3 is released: the rotary gain is folded into the softmax
        if not (config.rope_factor > 1 and isinstance(config.rope_original_context, int)
                and config.rope_original_context >= 1):
            raise ConfigError(f"model.rope_scaling=yarn needs model.rope_factor > 1 (got {config.rope_factor}) and "
                              f"model.rope_original_context >= 1 (got {config.rope_original_context!r})")
        if config.rope_attention_factor not in (None, 1.0) or not 0 < config.rope_beta_slow < config.rope_beta_fast:
            raise ConfigError(f"model.rope_attention_factor={config.rope_attention_factor!r} (the rotary gain: "
                              "DeepSeek-V3's is 1) and model.rope_beta_slow < rope_beta_fast, both positive, with "
                              "model.arch=deepseek_v3")
        config.rope_attention_factor = 1.0
    if config.num_experts:  # the block's fields (as the widths above fill them) and the experts', as every MoE's
        experts_config.check(config, ROPE_SCALINGS)
        _check_groups(config)
    else:  # latent attention with dense MLPs only
        check_attention(config, ROPE_SCALINGS)
        refuse_experts(config)


def _check_mlp(config: GPTConfig) -> None:
    if config.bias:
        raise ConfigError("model.bias=true with model.arch=deepseek_v3, which has no biases; leave it unset")
    config.bias = False
    if config.qk_norm:
        raise ConfigError("model.qk_norm=true with model.arch=deepseek_v3: its queries and keys are normalised as "
                          "latents (q_a_layernorm, kv_a_layernorm), not per head; leave it unset")
    config.qk_norm = False
    if config.norm_topk_prob is None:
        config.norm_topk_prob = True
    if config.num_experts and config.router_scoring != "sigmoid":
        raise ConfigError(f"model.router_scoring={config.router_scoring!r} with model.arch=deepseek_v3, whose router "
                          "scores each expert by a sigmoid: set model.router_scoring=sigmoid")
    if config.shared_expert_gate:
        raise ConfigError("model.shared_expert_gate=true with model.arch=deepseek_v3: its shared experts are added "
                          "ungated; leave it unset")
    if config.mlp_only_layers or config.decoder_sparse_step != 1:
        raise ConfigError("model.mlp_only_layers / decoder_sparse_step with model.arch=deepseek_v3: its dense layers "
                          "are the first ones; set model.first_dense_layers")


def _check_groups(config: GPTConfig) -> None:
    """Group-limited routing, the routed scaling factor and the leading dense layers."""
    check_size("router_groups", config.router_groups, experts_config.MAX_EXPERTS)
    check_size("router_topk_groups", config.router_topk_groups, experts_config.MAX_EXPERTS)
    if config.num_experts % config.router_groups or config.router_topk_groups > config.router_groups:
        raise ConfigError(f"model.router_groups={config.router_groups} must divide model.num_experts="
                          f"{config.num_experts}, and model.router_topk_groups={config.router_topk_groups} be at most it")
    per_group = config.num_experts // config.router_groups
    if config.router_groups > 1 and per_group < 2:
        raise ConfigError(f"model.router_groups={config.router_groups} leaves fewer than 2 experts per group; a "
                          "group is scored by its two best experts: use fewer groups")
    if config.router_groups > 1 and config.experts_per_token > config.router_topk_groups * per_group:
        raise ConfigError(f"model.experts_per_token={config.experts_per_token} is above the experts of "
                          f"model.router_topk_groups={config.router_topk_groups} groups; choose more groups")
    if not (isinstance(config.routed_scaling_factor, (int, float)) and 0 < config.routed_scaling_factor < 1e3):
        raise ConfigError(f"model.routed_scaling_factor={config.routed_scaling_factor!r} must be a number in "
                          "(0, 1000) (1: the routed sum as it is)")
    if type(config.first_dense_layers) is not int or not 0 <= config.first_dense_layers <= config.n_layer:
        raise ConfigError(f"model.first_dense_layers={config.first_dense_layers!r} must be a layer count in "
                          f"[0, n_layer={config.n_layer}]")


def _width(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= WIDTH_LIMIT:
        raise ConfigError(f"model.{name}={value!r} must be a positive integer of at most {WIDTH_LIMIT}")
