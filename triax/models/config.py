"""A decoder-only transformer's shape, for every architecture triax builds, and the preset table.

Every family shares one config (as litgpt's one Config serves all its architectures), because
nearly every field means the same in each and every layout, snapshot and command reads it. What a
family is (its blocks, its checks of these fields, its presets) lives in its folder,
triax/models/<family>/, registered in triax/models/registry.py; `model.arch` names one of its
architectures (also the transformers `model_type` `triax export --format hf` writes).

A field left unset (None) takes the architecture's own value in `__post_init__` (the family's
check), so a built config (and a run's model.json) always holds every value explicitly.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Optional

from triax.errors import ConfigError
from triax.models.family import ARCHITECTURES, PRESETS, FamilySpec, spec_of



# Upper bounds on a model's sizes, checked before anything is allocated: each is several times the
# largest in published GPT-style models (widths of 25,600, ~100 layers, vocabularies of ~256k,
# contexts of ~1M, MLPs of ~100k), so a typo or a hostile file (n_embd=1000000, vocab_size=2**40)
# is refused instead of asking for terabytes.
MAX_SIZES = {"vocab_size": 2**24, "block_size": 2**21, "n_layer": 1024, "n_head": 1024, "n_embd": 2**16}
MAX_OPTIONAL_SIZES = {"n_kv_head": 1024, "head_dim": 2**12, "intermediate_size": 2**20}
SIZE_REASON = "several times the largest published GPT-style models; a larger value is a typo or a damaged file"

# model.arch when none is given: GPT-2's (the first family; its presets set no arch).
DEFAULT_ARCH = "gpt2"

# The one preset table (`model=NAME` for `triax train`, `--model NAME` for `triax plan` and
# `triax bench`), filled from the registered families' presets (triax.models.family); each sets
# these GPTConfig fields; "vocab_size" is only the vocabulary `triax plan` assumes (in training the
# data decides it).
PLAN_ONLY_PRESET_KEYS = ("vocab_size",)


def preset_fields(name: str) -> dict:
    """The GPTConfig fields preset `name` sets (without the plan's vocabulary hint)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets are: {', '.join(PRESETS)}")
    return {key: value for key, value in PRESETS[name].items() if key not in PLAN_ONLY_PRESET_KEYS}


@dataclass
class GPTConfig:
    """The decoder's shape. `triax train`'s model.* keys are these fields (their defaults and the
    docstrings below), less vocab_size, block_size and padded_vocab_size, which the data and the
    layout decide."""

    vocab_size: int
    """Token ids are < this."""

    block_size: int
    """Context length in tokens."""

    arch: str = DEFAULT_ARCH
    """Architecture: gpt2 (learned positions, LayerNorm, GELU) | llama (rotary positions, RMSNorm,
    SwiGLU, grouped-query attention) | qwen2 (llama with biases on q/k/v) | mistral (llama, exported as
    transformers' Mistral) | qwen3 (llama with q/k norm per head) | mixtral, qwen3_moe (llama with a
    mixture-of-experts MLP: triax/models/moe/)."""

    n_layer: int = 4
    """Transformer blocks."""

    n_head: int = 4
    """Attention (query) heads."""

    n_embd: int = 128
    """Width of the residual stream."""

    n_kv_head: Optional[int] = None
    """Key/value heads (grouped-query attention; llama family); must divide n_head; unset = n_head."""

    head_dim: Optional[int] = None
    """Width of one attention head; unset = n_embd / n_head (which gpt2 requires)."""

    intermediate_size: Optional[int] = None
    """Hidden width of the MLP; unset = 4 x n_embd (gpt2) or 8/3 x n_embd rounded up to a multiple of 32 (llama
    family)."""

    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches."""

    bias: Optional[bool] = None
    """Biases in Linear and norm layers; unset = the architecture's (gpt2: true; llama family: false)."""

    tie_embeddings: bool = False
    """Share the token embedding with the output head."""

    gelu: str = "tanh"
    """gpt2's MLP activation: tanh (GPT-2's approximation, what its weights were trained with) | exact
    (erf, as nn.GELU and nanoGPT; about 3x cheaper on a CPU)."""

    norm_eps: float = 1e-5
    """Epsilon of the LayerNorms (gpt2) or RMSNorms (llama family)."""

    rope_theta: float = 10000.0
    """Base of the rotary position frequencies (llama family)."""

    rope_scaling: str = "none"
    """Rotary frequency scaling (llama family): none | linear | llama3 (Llama 3.1's)."""

    rope_factor: float = 8.0
    """rope_scaling's factor (linear, llama3)."""

    rope_low_freq_factor: float = 1.0
    """rope_scaling=llama3: wavelengths beyond rope_original_context / this are divided by rope_factor."""

    rope_high_freq_factor: float = 4.0
    """rope_scaling=llama3: wavelengths below rope_original_context / this are kept."""

    rope_original_context: int = 8192
    """rope_scaling=llama3: the context the model was pre-trained with before scaling."""

    padded_vocab_size: Optional[int] = None
    """Rows of the embedding and head when the vocabulary is padded (to a multiple of the tensor-
    parallel degree, so it splits evenly); None: no padding. Padding rows start at zero, their
    logits are masked out, so they never take probability, gradient or a sampled id."""

    qk_norm: Optional[bool] = None
    """RMSNorm over each query and key head before the rotary positions (Qwen3's); unset = the
    architecture's (qwen3, qwen3_moe: true; others: false)."""

    num_experts: int = 0
    """Routed experts of a mixture-of-experts MLP (mixtral, qwen3_moe; triax/models/experts.py); 0 = a dense MLP."""

    experts_per_token: int = 2
    """Experts each token is routed to (top-k; transformers' num_experts_per_tok)."""

    moe_intermediate_size: Optional[int] = None
    """Hidden width of each expert's SwiGLU; unset = intermediate_size."""

    norm_topk_prob: Optional[bool] = None
    """Renormalise the top-k routing weights to sum to one (mixtral: always); unset = the architecture's
    (mixtral: true, qwen3_moe: false, as transformers' default)."""

    decoder_sparse_step: int = 1
    """qwen3_moe: layer i has experts when (i + 1) is a multiple of this (and i is not in mlp_only_layers)."""

    mlp_only_layers: Optional[list[int]] = None
    """qwen3_moe: layer numbers whose MLP is dense (intermediate_size wide) instead of experts."""

    shared_expert_intermediate_size: int = 0
    """Width of a shared expert beside the routed ones, through which every token also passes
    (Qwen2-MoE's, DeepSeek's); 0 = none."""

    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(a learned linear of the token) (Qwen2-MoE); false = add
    it as is (DeepSeek)."""

    router_scoring: str = "softmax"
    """How the router scores experts: softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3: each expert scored
    on its own; the chosen scores renormalised when norm_topk_prob)."""

    router_bias_update_rate: float = 0.0
    """DeepSeek-V3's balancing without an auxiliary loss: a per-expert bias added to the scores for choosing
    experts only (not for weighting them), raised by this much after each step for every expert that got
    fewer tokens than the mean and lowered for those that got more; 0 = no bias. DeepSeek-V3 used 0.001."""

    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (transformers' load_balancing_loss_func) added to the LM loss; 0 = off."""

    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean squared logsumexp of the router logits, ST-MoE); 0 = off."""

    # Attention sinks, sliding-window layers, the clamped SwiGLU and YaRN's rotary scaling: the
    # fields of the families that compute them (each family's checks give their defaults).

    attention_sinks: Optional[bool] = None
    """A learned logit per attention head in each softmax's denominator (a "sink" taking probability
    without a value, so a query may attend to nothing); unset = the architecture's."""

    sliding_window: Optional[int] = None
    """Keys a query of a sliding-window layer sees: itself and the sliding_window - 1 before it
    (transformers' sliding_window); None: every layer attends to the whole context."""

    layer_types: Optional[list[str]] = None
    """Each layer's attention, sliding_attention | full_attention (transformers' layer_types); unset =
    alternating, sliding first, when sliding_window is set."""

    swiglu_limit: Optional[float] = None
    """The experts' clamped SwiGLU: the gate clamped above at this and the up projection to [-limit,
    limit], then (up + 1) * gate * sigmoid(swiglu_alpha * gate); unset = the architecture's."""

    swiglu_alpha: float = 1.702
    """The clamped SwiGLU's sigmoid gain (1.702: the sigmoid approximation of GELU)."""

    rope_beta_fast: float = 32.0
    """rope_scaling=yarn: rotations per context below which a frequency starts to be interpolated."""

    rope_beta_slow: float = 1.0
    """rope_scaling=yarn: rotations per context below which a frequency is interpolated fully."""

    rope_truncate: bool = True
    """rope_scaling=yarn: round the interpolation ramp's bounds to whole dimensions."""

    rope_attention_factor: Optional[float] = None
    """rope_scaling=yarn: the gain of the rotary cos and sin; unset = 0.1 ln(rope_factor) + 1."""

    # Multi-head latent attention and group-limited routing (DeepSeek-V2 and V3 introduced them).

    q_lora_rank: Optional[int] = None
    """Width of the queries' low-rank latent (a down projection, an RMSNorm, an up projection to the heads); unset
    = queries projected from the residual stream directly. Only with kv_lora_rank > 0."""

    kv_lora_rank: int = 0
    """Width of the keys' and values' shared latent: the one thing a generation cache keeps per token (with the
    qk_rope_head_dim rotary key values); 0 = plain multi-head attention."""

    qk_nope_head_dim: Optional[int] = None
    """Values of each query/key head without rotary positions (latent attention); unset = 128."""

    qk_rope_head_dim: Optional[int] = None
    """Values of each query/key head that carry rotary positions (latent attention; the key's are shared by every
    head); unset = 64."""

    v_head_dim: Optional[int] = None
    """Width of each value head (latent attention); unset = qk_nope_head_dim."""

    router_groups: int = 1
    """Experts are split into this many equal groups; a token chooses its experts within router_topk_groups
    groups only (those whose two best scores sum highest); 1 = no groups."""

    router_topk_groups: int = 1
    """Groups each token's experts may come from (router_groups > 1)."""

    routed_scaling_factor: float = 1.0
    """The routed experts' weighted sum is multiplied by this (DeepSeek-V3: 2.5) before the shared expert is added."""

    first_dense_layers: int = 0
    """The first this many layers have a dense MLP (intermediate_size wide) instead of experts."""

    # Optional[...] rather than `X | None` above: OmegaConf (the model.* schema is built from these
    # fields) reads typing's Optional only.

    def __post_init__(self):
        spec = spec_of(self.arch)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_size(name, getattr(self, name), MAX_SIZES[name])
        for name, limit in MAX_OPTIONAL_SIZES.items():
            if getattr(self, name) is not None:
                check_size(name, getattr(self, name), limit)
        if self.padded_vocab_size is not None and (not isinstance(self.padded_vocab_size, int)
                                                   or self.padded_vocab_size < self.vocab_size):
            raise ConfigError(f"padded_vocab_size must be an integer >= vocab_size={self.vocab_size}, "
                              f"got {self.padded_vocab_size!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            raise ConfigError(f"model.norm_eps={self.norm_eps!r} must be a small positive number such as 1e-5")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e3):
                raise ConfigError(f"model.{name}={value!r} must be a number in [0, 1000) (0 turns it off)")
        refuse_unhonoured(self, spec)  # before the check, which may fill the family's own mechanisms
        spec.check(self)  # the family's own fields and defaults

    @property
    def family(self) -> str:
        """The name of the family that builds this architecture (its folder under triax/models/)."""
        return spec_of(self.arch).name

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (transformers' Qwen3-MoE rule)."""
        return (self.num_experts > 0 and layer >= self.first_dense_layers and layer not in (self.mlp_only_layers or [])
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def qkv_bias(self) -> bool:
        """Biases on the query/key/value projections: Qwen2's, or every layer's (bias)."""
        qkv_bias = spec_of(self.arch).qkv_bias
        return bool(self.bias or (qkv_bias is not None and qkv_bias(self)))

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> "GPTConfig":
        return cls(**{**preset_fields(name), **kwargs})

    @property
    def vocab_rows(self) -> int:
        """Rows of the token embedding and the head (the vocabulary with its padding)."""
        return self.padded_vocab_size or self.vocab_size


# Fields that are training choices (dropout, the router losses' weights) or the layout's (padding),
# not part of the function a trained model computes.
TRAINING_FIELDS = ("dropout", "padded_vocab_size", "router_aux_loss_coef", "router_z_loss_coef")


def architecture_fields(config: GPTConfig) -> dict:
    """The fields that define a trained model's function: all but TRAINING_FIELDS. A checkpoint to
    start from fixes these."""
    return {key: value for key, value in asdict(config).items() if key not in TRAINING_FIELDS}


def refuse_experts(config: GPTConfig) -> None:
    """For a family whose experts are optional (DeepSeek-V3's, with num_experts=0): the routing fields
    must keep their defaults. (A family that never has experts leaves them out of its
    FamilySpec.honours, and GPTConfig refuses them for it.)"""
    if config.router_scoring != "softmax" or config.router_bias_update_rate:
        raise ConfigError(f"model.router_scoring / router_bias_update_rate with model.arch={config.arch}: they "
                          "route experts, which this architecture has none of; choose a model.arch with experts")
    if config.shared_expert_intermediate_size or config.shared_expert_gate:
        raise ConfigError(f"model.shared_expert_intermediate_size with model.arch={config.arch}: a shared expert "
                          "sits beside routed ones, which this architecture has none of; choose a model.arch with "
                          "experts")
    if config.num_experts:
        raise ConfigError(f"model.num_experts={config.num_experts} with model.arch={config.arch}: this architecture "
                          "has no experts; set num_experts=0 or choose a model.arch with experts")


# The optional mechanisms: fields only the families listing them in FamilySpec.honours compute, each
# with what it does (for the refusal, "<arch> does not ..."). Elsewhere a value away from the
# field's default is refused: model.arch=llama model.attention_sinks=true would otherwise train a
# plain Llama. The router losses' weights are not among them: they are training choices
# (TRAINING_FIELDS), given before model.init_from's checkpoint decides the architecture.
_YARN = "scale its rotary positions with YaRN (model.rope_scaling=yarn)"
_LATENT = "compute multi-head latent attention"
MECHANISMS = {
    "attention_sinks": "compute attention sinks", "sliding_window": "have sliding-window attention layers",
    "layer_types": "have sliding-window attention layers", "swiglu_limit": "clamp its SwiGLU",
    "swiglu_alpha": "clamp its SwiGLU", "rope_beta_fast": _YARN, "rope_beta_slow": _YARN, "rope_truncate": _YARN,
    "rope_attention_factor": _YARN, "q_lora_rank": _LATENT, "kv_lora_rank": _LATENT, "qk_nope_head_dim": _LATENT,
    "qk_rope_head_dim": _LATENT, "v_head_dim": _LATENT, "router_groups": "route experts within groups",
    "router_topk_groups": "route experts within groups", "routed_scaling_factor": "scale its routed experts' sum",
    "first_dense_layers": "have leading dense layers before its experts (model.first_dense_layers)",
    **dict.fromkeys(("num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob"),
                    "route tokens to experts"),
    "router_scoring": "choose how its router scores experts", "router_bias_update_rate": "balance its experts "
    "with a bias on the router's scores", "shared_expert_intermediate_size": "have a shared expert",
    "shared_expert_gate": "have a shared expert", "decoder_sparse_step": "interleave dense layers with its experts",
    "mlp_only_layers": "interleave dense layers with its experts",
}


def honouring(name: str) -> list[str]:
    """The registered architectures whose family computes mechanism field `name`."""
    return [arch for arch, spec in ARCHITECTURES.items() if name in spec.honours]


def refuse_unhonoured(config: GPTConfig, spec: FamilySpec) -> None:
    """One line for the first mechanism field set away from its default that `spec`'s family does not compute."""
    defaults = {field.name: field.default for field in fields(GPTConfig) if field.default is not MISSING}
    for name, mechanism in MECHANISMS.items():
        value = getattr(config, name)
        if name in spec.honours or value == defaults[name]:
            continue
        raise ConfigError(f"model.{name}={value!r} with model.arch={config.arch}: {config.arch} does not {mechanism}; "
                          f"choose a model.arch that does ({', '.join(honouring(name)) or 'none is registered'})")


def check_size(name: str, value: object, limit: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"model.{name}={value!r} must be a positive integer")
    if value > limit:
        raise ConfigError(f"model.{name}={value} is above triax's bound of {limit} ({SIZE_REASON}); "
                          "use a smaller value")


def check_rotary(config: GPTConfig, scalings: tuple[str, ...]) -> None:
    """The rotary fields, for a family whose rotary positions scale in one of `scalings` (none,
    linear, llama3, yarn): one check for every family, each naming the scalings it computes."""
    if config.rope_scaling not in scalings:
        raise ConfigError(f"model.rope_scaling={config.rope_scaling!r} with model.arch={config.arch}: choose one of "
                          f"{', '.join(scalings)}")
    if not (config.rope_theta > 1 and config.rope_factor >= 1):
        raise ConfigError(f"model.rope_theta={config.rope_theta} must be > 1 and model.rope_factor="
                          f"{config.rope_factor} >= 1")
    if config.rope_scaling == "llama3" and not (0 < config.rope_low_freq_factor < config.rope_high_freq_factor
                                                and config.rope_original_context >= 1):
        raise ConfigError(f"model.rope_low_freq_factor={config.rope_low_freq_factor} must be positive and below "
                          f"model.rope_high_freq_factor={config.rope_high_freq_factor}, and "
                          f"model.rope_original_context={config.rope_original_context} positive")
    if config.rope_scaling == "yarn":
        if not (0 < config.rope_beta_slow < config.rope_beta_fast and config.rope_original_context >= 1):
            raise ConfigError(f"model.rope_beta_slow={config.rope_beta_slow} must be positive and below "
                              f"model.rope_beta_fast={config.rope_beta_fast}, and model.rope_original_context="
                              f"{config.rope_original_context} positive")
        gain = config.rope_attention_factor
        if gain is not None and not (isinstance(gain, (int, float)) and 0 < gain < 100):
            raise ConfigError(f"model.rope_attention_factor={gain!r} must be a positive gain such as 1.35 (or unset)")
