"""Mixtures of experts (model.arch=mixtral | qwen3_moe): the Llama family's block with its MLP
replaced, in the layers the config names, by routed experts.

A linear router (`gate`) scores every expert for each token; the token goes to its top-k experts
(softmax over all experts, the top k kept, renormalised to sum to one when `norm_topk_prob`, as
transformers' Mixtral and Qwen3-MoE compute it: Mixtral's "softmax over the chosen logits" is the
renormalised case). Routing is dropless: no capacity factor, every token reaches its k experts,
so the loss is transformers'.

The experts are held as three batched parameters, [num_experts, out, in] each (nn.Linear's layout
per expert), so fully-sharded and expert parallelism split them along the expert dimension like
any other tensor. Tokens are sorted by expert and each weight applied to its contiguous group in
one grouped matmul (torch's F.grouped_mm where this build has it and the sizes are aligned for
it; a loop over the experts' groups otherwise).

Each routed block keeps its last router logits (`router_logits`) and token counts for the
router's losses and the per-expert shares (triax/models/router_loss.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.errors import ConfigError
from triax.models.config import MAX_OPTIONAL_SIZES, MAX_SIZES, GPTConfig, check_size
from triax.models.decoder import Block, SelfAttention
from triax.models.family import FamilySpec
from triax.models.init import init_normal
from triax.models.llama import Llama, RotaryEmbedding, SwiGLU, check_attention

# The architectures this family builds (transformers' model_type).
ARCHITECTURES = ("mixtral", "qwen3_moe")
MAX_EXPERTS = 2**14  # published MoEs route over at most a few hundred experts

# CPU-sized, then the published shapes (Mixtral 8x7B, Qwen3-30B-A3B: 128 experts, 8 per token).
FAMILY_PRESETS: dict[str, dict] = {
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


def check(config: GPTConfig) -> None:
    """The Llama block's fields, then the experts': sizes, routing, which layers have them."""
    check_attention(config)
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


def route(logits: torch.Tensor, top_k: int, normalise: bool, scoring: str = "softmax",
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) of each token's top_k experts, (tokens, top_k) each: scores in fp32
    (softmax over every expert, or each expert's sigmoid), the k largest, renormalised when asked
    (transformers' order of operations). `bias` (DeepSeek-V3's balancing) shifts the scores for
    choosing the experts only; the weights are the unbiased scores of those chosen."""
    scores = F.softmax(logits.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(logits.float())
    if bias is None:
        weights, experts = torch.topk(scores, top_k, dim=-1)
    else:
        experts = torch.topk(scores + bias.float(), top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """F.grouped_mm takes fp32/bf16/fp16 and needs 16-byte aligned rows (its kernels read whole vectors)."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(size * x.element_size() % 16 == 0 for size in weight.shape[1:])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by expert (counts[e] rows for expert e, in order) times each expert's
    nn.Linear-layout weight [experts, out, in]: (rows, out)."""
    if _grouped_mm_fits(x, weight):
        ends = counts.cumsum(0).to(torch.int32)
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    parts = [x_e @ weight[e].t() for e, x_e in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.size(1))


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This process's experts of a weight split over expert-parallel ranks (a DTensor), or the weight."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs held as batched weights: gate_proj and up_proj [experts, width,
    n_embd], down_proj [experts, n_embd, width]."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        experts, width, embd = config.num_experts, config.moe_intermediate_size, config.n_embd
        self.gate_proj = nn.Parameter(torch.empty(experts, width, embd))
        self.up_proj = nn.Parameter(torch.empty(experts, width, embd))
        self.down_proj = nn.Parameter(torch.empty(experts, embd, width))
        # Set from outside by expert parallelism (triax/parallel/expert_parallel.py): sends the rows
        # to the ranks holding their experts and brings the outputs back.
        self.exchange = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: token rows sorted by expert, counts[e] of them for expert e."""
        if self.exchange is not None:
            return self.exchange(x, counts, self)
        return self.local_forward(x, counts)

    def local_forward(self, x: torch.Tensor, counts: torch.Tensor, weight_of: Callable = _local) -> torch.Tensor:
        """Through the experts this process holds (all of them without expert parallelism);
        `weight_of(parameter)`: the tensor to compute with."""
        gate, up, down = (weight_of(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        hidden = F.silu(grouped_linear(x, gate, counts)) * grouped_linear(x, up, counts)
        return grouped_linear(hidden, down, counts)


class MoE(nn.Module):
    """The routed MLP: each token through its top-k experts, their outputs summed by the routing
    weights. Keeps the last forward's router logits and per-expert token counts (the losses and
    the load statistics are computed from them after the forward)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.top_k, self.normalise = config.experts_per_token, config.norm_topk_prob
        self.scoring = config.router_scoring
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.n_embd, config.num_experts, bias=False)
        self.experts = GroupedExperts(config)
        # A shared expert every token also passes through (Qwen2-MoE gates it, DeepSeek adds it).
        width = config.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(config, width) if width else None
        if self.shared_expert is not None:
            self.shared_expert.dropout = nn.Identity()  # the block's own dropout follows the sum
        self.shared_expert_gate = nn.Linear(config.n_embd, 1, bias=False) if config.shared_expert_gate else None
        self.dropout = nn.Dropout(config.dropout)
        self.router_logits: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        if config.router_bias_update_rate:
            # DeepSeek-V3's selection bias (a buffer: not trained by gradients, saved in snapshots), and
            # the tokens each expert got over this training step's forwards, for its update.
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
            self.step_load: torch.Tensor | None = None  # (built on the meta device: made at the first forward)
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        weights, experts = route(logits, self.top_k, self.normalise, self.scoring, self.expert_bias)
        self.router_logits = logits
        flat = experts.reshape(-1)
        # Sorted by expert (stable: a token's rows keep their order); row r of the sorted list is
        # token order[r] // top_k.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.tokens_per_expert = counts.detach()
        if self.expert_bias is not None and self.training:
            load = counts.detach().float()
            self.step_load = load if self.step_load is None else self.step_load + load
        tokens = order // self.top_k
        out = self.experts(x[tokens], counts)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        return self.dropout(y.view(shape))


class Mixture(Llama):
    """The mixture-of-experts decoders (model.arch=mixtral | qwen3_moe): Llama blocks whose MLP is
    an MoE in the layers `config.has_experts` names, a dense SwiGLU in the others."""

    family = "moe"

    def make_block(self, config: GPTConfig, layer: int = 0) -> nn.Module:
        if "rotary" not in self.__dict__:
            self.rotary = RotaryEmbedding(config)
        mlp = MoE(config) if config.has_experts(layer) else SwiGLU(config)
        return Block(self.make_norm(config), SelfAttention(config, self.rotary), self.make_norm(config), mlp)

    def init_weights(self, seed: int | None = None) -> None:
        """Decoder's initialisation, and the experts' batched weights alike: N(0, 0.02), the
        down projections (residual) scaled by 1/sqrt(2 * n_layer); the router is a Linear."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        super().init_weights(seed)
        residual_std = 0.02 / (2 * self.config.n_layer) ** 0.5
        for module_name, module in self.named_modules():
            if isinstance(module, GroupedExperts):
                for name, parameter in module.named_parameters():
                    std = residual_std if name == "down_proj" else 0.02
                    init_normal(parameter, seed, f"{module_name}.{name}", std)
            if isinstance(module, MoE) and module.expert_bias is not None:
                module.expert_bias.zero_()

    def active_params(self) -> int:
        """Parameters one token passes through: all but the experts it is not routed to."""
        c = self.config
        idle = 0
        for module in self.modules():
            if isinstance(module, GroupedExperts):
                per_expert = sum(p.numel() for p in module.parameters()) // c.num_experts
                idle += per_expert * (c.num_experts - c.experts_per_token)
        return self.num_params() - idle

    def flops_per_token(self, seq_len: int | None = None, num_params: int | None = None) -> float:
        """The PaLM formula over the active parameters (a token's FLOPs go through top-k experts only)."""
        if num_params is None:
            num_params = self.active_params()
        return super().flops_per_token(seq_len, num_params)


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float, all_reduce: Callable | None = None) -> None:
    """DeepSeek-V3's balancing step, after each optimizer step: each routed layer's bias rises by
    `rate` for experts that got fewer tokens than the mean over this step's forwards and falls for
    those that got more. `all_reduce(tensor)`: sums the loads over data-parallel ranks, so that
    every rank makes the same update."""
    for module in model.modules():
        if isinstance(module, MoE) and module.expert_bias is not None:
            load = module.step_load
            if load is None:  # no training forward this step (every rank has one: data parallelism)
                load = torch.zeros_like(module.expert_bias)
            load = load.to(module.expert_bias.device, torch.float32)
            if all_reduce is not None:
                all_reduce(load)
            module.expert_bias += rate * torch.sign(load.mean() - load)
            module.step_load = None


SPEC = FamilySpec(name="moe", architectures=ARCHITECTURES, model=Mixture, check=check, presets=FAMILY_PRESETS)
