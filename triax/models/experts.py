"""Routed experts, for every family whose MLP is a mixture of experts: the router's choice
(`route`), the experts held as batched weights and applied in grouped matmuls (`GroupedExperts`),
the routed MLP (`MoE`), and DeepSeek-V3's bias update (`update_expert_bias`).

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

from triax.models.config import GPTConfig
from triax.models.llama.model import SwiGLU


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

    def choose_experts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) of each token's top-k experts from the router's logits (a family that
        routes in another order of operations overrides this)."""
        return route(logits, self.top_k, self.normalise, self.scoring, self.expert_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        weights, experts = self.choose_experts(logits)
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
            # Only the sign of each expert's distance from the mean counts: under activation
            # checkpointing every forward of the layer runs twice, doubling every load alike.
            module.expert_bias += rate * torch.sign(load.mean() - load)
            module.step_load = None

