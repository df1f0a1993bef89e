"""DeepSeek-V3's decoder (model.arch=deepseek_v3; Kimi K2 and Moonlight share it): the mixture of
experts of triax/models/moe.py (sigmoid scores, the correction bias, group-limited choice, the
routed scaling factor, shared experts; the first `first_dense_layers` layers dense) with multi-head
latent attention (attention.py) in place of grouped-query attention."""

from __future__ import annotations

import torch
import torch.nn as nn

from triax.models.config import GPTConfig
from triax.models.decoder import Block
from triax.models.deepseek_v3.attention import LatentAttention
from triax.models.deepseek_v3.yarn import softmax_factor, yarn_inverse_frequencies
from triax.models.llama import RotaryEmbedding, SwiGLU
from triax.models.moe import MoE, Mixture


def group_limited_route(logits: torch.Tensor, top_k: int, normalise: bool, bias: torch.Tensor, groups: int,
                        topk_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) of each token's top_k experts, (tokens, top_k) each, as DeepSeek-V3
    chooses them: each expert scored by a sigmoid (fp32), the correction `bias` added to choose; the
    experts cut into `groups` equal groups, each scored by the sum of its two best choosing scores,
    and the experts chosen among those of the `topk_groups` best groups only; the weights are the
    chosen experts' unbiased scores, renormalised to sum to one when `normalise`."""
    scores = torch.sigmoid(logits.float())
    choosing = scores + bias.float()
    if groups > 1:
        grouped = choosing.view(*choosing.shape[:-1], groups, -1)
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(dim=-1), topk_groups, dim=-1).indices
        kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)
        choosing = grouped.masked_fill(~kept[..., None], float("-inf")).view_as(choosing)
    experts = torch.topk(choosing, top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class RoutedMLP(MoE):
    """The routed MLP, choosing experts as group_limited_route does and scaling their weights by
    routed_scaling_factor; always with the correction bias of the experts' scores (DeepSeek-V3's
    e_score_correction_bias: released checkpoints hold it, trained or not). The bias is a buffer:
    moved by the balancing update (model.router_bias_update_rate), never by gradients."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        if self.expert_bias is None:
            del self.expert_bias
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
            self.step_load = None
        self.groups, self.topk_groups = config.router_groups, config.router_topk_groups
        self.scaling = config.routed_scaling_factor

    def choose_experts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = group_limited_route(logits, self.top_k, self.normalise, self.expert_bias, self.groups,
                                               self.topk_groups)
        return weights * self.scaling, experts


class DeepseekV3(Mixture):
    """Blocks of latent attention and an MLP that is routed (RoutedMLP) in the layers
    `config.has_experts` names, dense (SwiGLU) in the others. See Decoder for the arguments."""

    family = "deepseek_v3"

    def make_block(self, config: GPTConfig, layer: int = 0) -> nn.Module:
        if "rotary" not in self.__dict__:  # one table for all layers, of the rotary values only
            self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim)
            if config.rope_scaling == "yarn":
                self.rotary.inverse = yarn_inverse_frequencies(config, config.qk_rope_head_dim)
        mlp = RoutedMLP(config) if config.has_experts(layer) else SwiGLU(config)
        attention = LatentAttention(config, self.rotary, softmax_factor(config))
        return Block(self.make_norm(config), attention, self.make_norm(config), mlp)

    def latent_cache_values(self) -> int:
        """Values a generation cache keeps per token: each layer's latent and rotary key."""
        return self.config.n_layer * (self.config.kv_lora_rank + self.config.qk_rope_head_dim)
