"""Mixtures of experts (model.arch=mixtral | qwen3_moe): the Llama family's block with its MLP
replaced, in the layers the config names, by routed experts (triax/models/experts.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from triax.models.config import GPTConfig
from triax.models.decoder import Block, SelfAttention
from triax.models.experts import MoE, GroupedExperts
from triax.models.init import init_normal
from triax.models.llama.model import Llama, RotaryEmbedding, SwiGLU


class Mixture(Llama):
    """The mixture-of-experts decoders (model.arch=mixtral | qwen3_moe): Llama blocks whose MLP is
    an MoE in the layers `config.has_experts` names, a dense SwiGLU in the others."""

    family = "moe"
    attends_by_mask = False  # the router balances over every position fed, padding included

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
