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
from triax.models.llama import RotaryEmbedding, SwiGLU
from triax.models.moe import MoE, Mixture


class RoutedMLP(MoE):
    """The routed MLP, always with the correction bias of the experts' scores (DeepSeek-V3's
    e_score_correction_bias: released checkpoints hold it, trained or not). It is a buffer: moved
    by the balancing update (model.router_bias_update_rate), never by gradients."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        if self.expert_bias is None:
            del self.expert_bias
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
            self.step_load = None


class DeepseekV3(Mixture):
    """Blocks of latent attention and an MLP that is routed (RoutedMLP) in the layers
    `config.has_experts` names, dense (SwiGLU) in the others. See Decoder for the arguments."""

    family = "deepseek_v3"

    def make_block(self, config: GPTConfig, layer: int = 0) -> nn.Module:
        if "rotary" not in self.__dict__:  # one table for all layers, of the rotary values only
            self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim)
        mlp = RoutedMLP(config) if config.has_experts(layer) else SwiGLU(config)
        return Block(self.make_norm(config), LatentAttention(config, self.rotary), self.make_norm(config), mlp)

    def latent_cache_values(self) -> int:
        """Values a generation cache keeps per token: each layer's latent and rotary key."""
        return self.config.n_layer * (self.config.kv_lora_rank + self.config.qk_rope_head_dim)
