"""A decoder-only transformer's shape, for every architecture triax builds, and the preset table.

Two families share one config (as litgpt's one Config serves all its architectures), because
nearly every field means the same in both and every layout, snapshot and command reads it:
- `gpt2`: GPT-2's blocks (triax/models/gpt.py): learned positions, LayerNorm, GELU MLP, full
  multi-head attention.
- `llama`, `qwen2`, `mistral`: the Llama family (triax/models/llama.py): rotary positions,
  RMSNorm, SwiGLU MLP, grouped-query attention. The three compute the same block, up to Qwen2's
  biases on the query/key/value projections; the name is also the transformers `model_type`
  `triax export --format hf` writes.

A field left unset (None) takes the architecture's own value in `__post_init__`, so a built
config (and a run's model.json) always holds every value explicitly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from triax.errors import ConfigError

# model.arch -> family (the module that builds it).
ARCHITECTURES = {"gpt2": "gpt", "llama": "llama", "qwen2": "llama", "mistral": "llama", "qwen3": "llama",
                 "mixtral": "moe", "qwen3_moe": "moe"}
LLAMA_FAMILY = tuple(name for name, family in ARCHITECTURES.items() if family == "llama")

# model.gelu -> F.gelu's `approximate` argument.
GELU_FORMS = {"tanh": "tanh", "exact": "none"}

# Rotary frequency scalings: none (the original RoPE), linear (positions divided by rope_factor),
# llama3 (Llama 3.1's: low frequencies divided by rope_factor, high ones kept, smoothed between).
ROPE_SCALINGS = ("none", "linear", "llama3")

# Upper bounds on a model's sizes, checked before anything is allocated: each is several times the
# largest in published GPT-style models (widths of 25,600, ~100 layers, vocabularies of ~256k,
# contexts of ~1M, MLPs of ~100k), so a typo or a hostile file (n_embd=1000000, vocab_size=2**40)
# is refused instead of asking for terabytes.
MAX_SIZES = {"vocab_size": 2**24, "block_size": 2**21, "n_layer": 1024, "n_head": 1024, "n_embd": 2**16}
MAX_OPTIONAL_SIZES = {"n_kv_head": 1024, "head_dim": 2**12, "intermediate_size": 2**20}
MAX_EXPERTS = 2**14  # published MoEs route over at most a few hundred experts
SIZE_REASON = "several times the largest published GPT-style models; a larger value is a typo or a damaged file"

# The one preset table: `model=NAME` for `triax train`, `--model NAME` for `triax plan` and
# `triax bench`. Each sets these GPTConfig fields; "vocab_size" is only the vocabulary `triax plan`
# assumes (in training the data decides it).
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
    # A Llama small enough for a CPU: grouped-query attention (2 key/value heads for 4 query heads).
    "llama-debug": dict(arch="llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352),
    # Llama 3.1's published shapes (for `triax plan`; 128,256 tokens, rope_theta 500000, llama3 scaling).
    "llama3-8b": dict(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                      rope_theta=500000.0, rope_scaling="llama3", vocab_size=128256),
    "llama3-70b": dict(arch="llama", n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672,
                       rope_theta=500000.0, rope_scaling="llama3", vocab_size=128256),
    # Qwen3 (q/k norm per head) and the mixtures of experts (triax/models/moe.py): CPU-sized, then
    # the published shapes (Qwen3-0.6B, Mixtral 8x7B, Qwen3-30B-A3B: 128 experts, 8 per token).
    "qwen3-debug": dict(arch="qwen3", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352),
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_dim=128,
                       intermediate_size=3072, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                       vocab_size=151936),
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
PLAN_ONLY_PRESET_KEYS = ("vocab_size",)


def preset_fields(name: str) -> dict:
    """The GPTConfig fields preset `name` sets (without the plan's vocabulary hint)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets are: {', '.join(PRESETS)}")
    return {key: value for key, value in PRESETS[name].items() if key not in PLAN_ONLY_PRESET_KEYS}


def swiglu_width(n_embd: int) -> int:
    """The llama family's default MLP width: 8/3 x n_embd (three matrices with the parameters of
    GPT's two of 4 x n_embd, as Llama chose), rounded up to a multiple of 32 for even kernels."""
    return -(-8 * n_embd // 3 // 32) * 32


@dataclass
class GPTConfig:
    """The decoder's shape. `triax train`'s model.* keys are these fields (their defaults and the
    docstrings below), less vocab_size, block_size and padded_vocab_size, which the data and the
    layout decide."""

    vocab_size: int
    """Token ids are < this."""

    block_size: int
    """Context length in tokens."""

    arch: str = "gpt2"
    """Architecture: gpt2 (learned positions, LayerNorm, GELU) | llama (rotary positions, RMSNorm,
    SwiGLU, grouped-query attention) | qwen2 (llama with biases on q/k/v) | mistral (llama, exported as
    transformers' Mistral) | qwen3 (llama with q/k norm per head) | mixtral, qwen3_moe (llama with a
    mixture-of-experts MLP: triax/models/moe.py)."""

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
    """Routed experts of a mixture-of-experts MLP (mixtral, qwen3_moe; triax/models/moe.py); 0 = a dense MLP."""

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

    # Optional[...] rather than `X | None` above: OmegaConf (the model.* schema is built from these
    # fields) reads typing's Optional only.

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"model.arch={self.arch!r} is unknown; choose one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            _check_size(name, getattr(self, name), MAX_SIZES[name])
        for name, limit in MAX_OPTIONAL_SIZES.items():
            if getattr(self, name) is not None:
                _check_size(name, getattr(self, name), limit)
        if self.padded_vocab_size is not None and (not isinstance(self.padded_vocab_size, int)
                                                   or self.padded_vocab_size < self.vocab_size):
            raise ConfigError(f"padded_vocab_size must be an integer >= vocab_size={self.vocab_size}, "
                              f"got {self.padded_vocab_size!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            raise ConfigError(f"model.norm_eps={self.norm_eps!r} must be a small positive number such as 1e-5")
        if self.family == "gpt":
            self._check_gpt2()
        else:
            self._check_llama()
        self._check_experts()

    @property
    def family(self) -> str:
        """gpt | llama: which module builds the blocks."""
        return ARCHITECTURES[self.arch]

    def _check_gpt2(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; "
                              f"choose n_embd as a multiple of n_head")
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        self.head_dim = self.n_embd // self.n_head if self.head_dim is None else self.head_dim
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd
        self.bias = True if self.bias is None else self.bias
        if self.n_kv_head != self.n_head or self.head_dim != self.n_embd // self.n_head:
            raise ConfigError(f"model.arch=gpt2 has one key/value head per query head of n_embd / n_head values "
                              f"(got n_kv_head={self.n_kv_head}, head_dim={self.head_dim}); leave them unset, or use "
                              f"model.arch=llama for grouped-query attention")
        rotary = {"rope_theta": 10000.0, "rope_scaling": "none", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
                  "rope_high_freq_factor": 4.0, "rope_original_context": 8192}
        changed = [name for name, default in rotary.items() if getattr(self, name) != default]
        if changed:
            raise ConfigError(f"model.{changed[0]}={getattr(self, changed[0])!r} applies to rotary positions, which "
                              f"model.arch=gpt2 does not have (it learns its positions); use model.arch=llama")
        if self.gelu not in GELU_FORMS:
            raise ConfigError(f"model.gelu={self.gelu!r} must be one of {', '.join(GELU_FORMS)}")

    def _check_llama(self) -> None:
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        if self.n_head % self.n_kv_head != 0:
            raise ConfigError(f"model.n_kv_head={self.n_kv_head} does not divide model.n_head={self.n_head}; each "
                              "key/value head serves a whole group of query heads: choose a divisor of n_head")
        if self.head_dim is None:
            if self.n_embd % self.n_head != 0:
                raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; "
                                  "choose n_embd as a multiple of n_head, or set model.head_dim")
            self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} is odd; rotary positions rotate pairs of values, "
                              "so a head needs an even width")
        self.intermediate_size = self.intermediate_size or swiglu_width(self.n_embd)
        if self.bias is None:
            self.bias = False
        if self.bias and self.arch != "llama":
            raise ConfigError(f"model.bias=true with model.arch={self.arch}: transformers' {self.arch} has no such "
                              "option" + (" (its biases are on q/k/v only, always)" if self.arch == "qwen2" else "")
                              + "; use model.arch=llama for biases in every linear layer")
        if self.gelu != "tanh":
            raise ConfigError(f"model.gelu={self.gelu!r} applies to model.arch=gpt2; the llama family's MLP is SwiGLU "
                              "(SiLU), which has no choice of form")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} is unknown; choose one of "
                              f"{', '.join(ROPE_SCALINGS)}")
        if not (self.rope_theta > 1 and self.rope_factor >= 1):
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 1 and model.rope_factor="
                              f"{self.rope_factor} >= 1")
        if self.rope_scaling == "llama3" and not (0 < self.rope_low_freq_factor < self.rope_high_freq_factor
                                                  and self.rope_original_context >= 1):
            raise ConfigError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be positive and below "
                              f"model.rope_high_freq_factor={self.rope_high_freq_factor}, and "
                              f"model.rope_original_context={self.rope_original_context} positive")

    def _check_experts(self) -> None:
        """The mixture-of-experts fields (and Qwen3's q/k norm), checked and given the architecture's defaults."""
        if self.qk_norm is None:
            self.qk_norm = self.arch in ("qwen3", "qwen3_moe")
        if self.qk_norm and self.family == "gpt":
            raise ConfigError("model.qk_norm=true applies to the llama family's attention; use model.arch=qwen3")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1e3):
                raise ConfigError(f"model.{name}={value!r} must be a number in [0, 1000) (0 turns it off)")
        if self.family != "moe":
            if self.router_scoring != "softmax" or self.router_bias_update_rate:
                raise ConfigError(f"model.router_scoring / router_bias_update_rate with model.arch={self.arch}: they "
                                  "route experts; use model.arch=mixtral or qwen3_moe")
            if self.shared_expert_intermediate_size or self.shared_expert_gate:
                raise ConfigError(f"model.shared_expert_intermediate_size with model.arch={self.arch}: a shared expert "
                                  "sits beside routed ones; use model.arch=mixtral or qwen3_moe")
            if self.num_experts:
                raise ConfigError(f"model.num_experts={self.num_experts} with model.arch={self.arch}: experts are "
                                  "built by model.arch=mixtral or qwen3_moe; set num_experts=0 or change the arch")
            return
        _check_size("num_experts", self.num_experts, MAX_EXPERTS)
        _check_size("experts_per_token", self.experts_per_token, MAX_EXPERTS)
        if self.experts_per_token > self.num_experts:
            raise ConfigError(f"model.experts_per_token={self.experts_per_token} is above model.num_experts="
                              f"{self.num_experts}; a token cannot be routed to more experts than there are")
        if self.moe_intermediate_size == 0:  # not unset: a width of zero, which no expert can have
            raise ConfigError("model.moe_intermediate_size=0: an expert's MLP width must be positive (leave it unset "
                              "for model.intermediate_size)")
        self.moe_intermediate_size = self.moe_intermediate_size or self.intermediate_size
        _check_size("moe_intermediate_size", self.moe_intermediate_size, MAX_OPTIONAL_SIZES["intermediate_size"])
        if self.norm_topk_prob is None:
            self.norm_topk_prob = self.arch == "mixtral"
        if self.arch == "mixtral" and not self.norm_topk_prob:
            raise ConfigError("model.norm_topk_prob=false with model.arch=mixtral: Mixtral always renormalises its "
                              "top-k weights; use model.arch=qwen3_moe for unnormalised weights")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"model.router_scoring={self.router_scoring!r} is unknown; choose softmax or sigmoid")
        if not (isinstance(self.router_bias_update_rate, (int, float)) and 0 <= self.router_bias_update_rate < 1):
            raise ConfigError(f"model.router_bias_update_rate={self.router_bias_update_rate!r} must be in [0, 1) "
                              "(0: no bias; DeepSeek-V3 used 0.001)")
        if self.arch == "mixtral" and self.router_scoring != "softmax":
            raise ConfigError("model.router_scoring=sigmoid with model.arch=mixtral: Mixtral's router is a softmax; "
                              "use model.arch=qwen3_moe for DeepSeek-V3's sigmoid scores")
        if self.shared_expert_intermediate_size:
            _check_size("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                        MAX_OPTIONAL_SIZES["intermediate_size"])
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ConfigError("model.shared_expert_gate=true without a shared expert; set "
                              "model.shared_expert_intermediate_size > 0")
        _check_size("decoder_sparse_step", self.decoder_sparse_step, MAX_SIZES["n_layer"])
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        bad = [i for i in self.mlp_only_layers if type(i) is not int or not 0 <= i < self.n_layer]
        if bad:
            raise ConfigError(f"model.mlp_only_layers holds {bad[0]!r}, not a layer number below "
                              f"n_layer={self.n_layer}")
        if self.arch == "mixtral" and (self.mlp_only_layers or self.decoder_sparse_step != 1):
            raise ConfigError("model.mlp_only_layers / decoder_sparse_step are qwen3_moe's; Mixtral has experts in "
                              "every layer: use model.arch=qwen3_moe")

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (transformers' Qwen3-MoE rule)."""
        return (self.family == "moe" and layer not in (self.mlp_only_layers or [])
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def qkv_bias(self) -> bool:
        """Biases on the query/key/value projections: Qwen2's, or every layer's (bias)."""
        return self.bias or self.arch == "qwen2"

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


def _check_size(name: str, value: object, limit: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"model.{name}={value!r} must be a positive integer")
    if value > limit:
        raise ConfigError(f"model.{name}={value} is above triax's bound of {limit} ({SIZE_REASON}); "
                          "use a smaller value")
