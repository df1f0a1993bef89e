"""The router's losses of a mixture of experts, from the logits each MoE block kept in its last
forward (triax/models/experts.py), and each expert's share of the routed tokens.

- load balancing (Switch Transformer, eq. 4-6), as transformers' `load_balancing_loss_func`
  computes it: over the rows of every routed layer together (pooled, not a mean of per-layer
  losses), num_experts x sum over experts of (the fraction of top-k assignments it got) x (its
  mean router probability). Its minimum, top_k, is a uniform load.
- z-loss (ST-MoE, Zoph et al. 2022): the mean over tokens and layers of logsumexp(logits)^2, which
  keeps the router's logits small (stable in low precision).

The model's loss is then LM loss + router_aux_loss_coef x balance + router_z_loss_coef x z, which
is what transformers' MixtralForCausalLM / Qwen3MoeForCausalLM return with output_router_logits=True
(they have no z-loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triax.models.experts import MoE


def moe_blocks(model: torch.nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def load_balancing_loss(logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func over these layers' router logits (tokens, experts)."""
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    probabilities = torch.zeros_like(assignments)
    rows = 0
    for layer in logits:
        probs = F.softmax(layer.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assignments = assignments + F.one_hot(chosen.reshape(-1), num_experts).sum(0).float()
        probabilities = probabilities + probs.sum(0)
        rows += layer.size(0)
    return num_experts * torch.sum((assignments / rows) * (probabilities / rows))


def z_loss(logits: list[torch.Tensor]) -> torch.Tensor:
    """Mean over every routed token of every layer of logsumexp(router logits)^2."""
    return torch.cat([torch.logsumexp(layer.float(), dim=-1) ** 2 for layer in logits]).mean()


def router_loss(model: torch.nn.Module, aux_coef: float, z_coef: float) -> torch.Tensor | None:
    """aux_coef x load balancing + z_coef x z-loss of the model's last forward; None without
    routed layers or with both coefficients 0."""
    blocks = moe_blocks(model)
    if not blocks or not (aux_coef or z_coef) or blocks[0].router_logits is None:
        return None
    logits = [block.router_logits for block in blocks]
    total = logits[0].new_zeros((), dtype=torch.float32)
    if aux_coef:
        total = total + aux_coef * load_balancing_loss(logits, blocks[0].num_experts, blocks[0].top_k)
    if z_coef:
        total = total + z_coef * z_loss(logits)
    return total


def expert_shares(model: torch.nn.Module) -> list[float]:
    """Each expert's share of the token assignments of the last forward, over every routed layer
    (1 / num_experts each when balanced)."""
    blocks = [block for block in moe_blocks(model) if block.tokens_per_expert is not None]
    if not blocks:
        return []
    counts = torch.stack([block.tokens_per_expert.float() for block in blocks]).sum(0)
    return (counts / counts.sum().clamp(min=1)).tolist()


def collapsed(shares: list[float], floor: float = 0.1) -> list[int]:
    """The experts that took under `floor` of a uniform share (dead experts of a collapsed router)."""
    return [expert for expert, share in enumerate(shares) if share < floor / len(shares)]
