"""DPO's loss of a batch of pairs, as TRL's DPOTrainer computes it: each row's answer
log-probability, and from the policy's and the reference's each pair's loss (sigmoid, ipo, hinge or
robust) and the metrics TRL logs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triax.data.targets import IGNORE_INDEX
from triax.objectives.dpo.config import DPOConfig

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def answer_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its targets (IGNORE_INDEX: not counted), in fp32."""
    losses = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none")
    if hasattr(losses, "full_tensor"):  # tensor parallel: the vocabulary-parallel loss, replicated
        losses = losses.full_tensor()
    return -losses.view(targets.shape).sum(dim=1)


def pair_losses(config: DPOConfig, logps: torch.Tensor, ref_logps: torch.Tensor,
                lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each pair's loss, each pair's metrics in METRICS order) of rows [chosen..., rejected...]."""
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = config.beta * (chosen_ratio - rejected_ratio)
    if config.loss_type == "sigmoid":
        losses = -F.logsigmoid(delta)
    elif config.loss_type == "hinge":
        losses = torch.relu(1 - delta)
    elif config.loss_type == "ipo":  # TRL's: the log-ratios per answer token, squared distance to 1/(2 beta)
        chosen_length, rejected_length = lengths.chunk(2)
        gap = chosen_ratio / chosen_length.clamp(min=1) - rejected_ratio / rejected_length.clamp(min=1)
        losses = (gap - 1 / (2 * config.beta)) ** 2
    else:  # robust: an unbiased loss under preferences flipped with probability label_smoothing
        smoothing = config.label_smoothing
        losses = (-(1 - smoothing) * F.logsigmoid(delta) + smoothing * F.logsigmoid(-delta)) / (1 - 2 * smoothing)
    with torch.no_grad():
        chosen_reward, rejected_reward = config.beta * chosen_ratio, config.beta * rejected_ratio
        stats = torch.stack([chosen_reward, rejected_reward, (chosen_reward > rejected_reward).float(),
                             chosen_reward - rejected_reward, chosen, rejected], dim=1)
    return losses, stats
