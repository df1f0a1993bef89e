"""The dpo.* keys: Direct Preference Optimization (Rafailov et al. 2023) on data.task=preference,
named and defined as TRL's DPOConfig names and defines them (docs/preference.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from triax.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


@dataclass
class DPOConfig:
    """DPO on preference pairs (data.task=preference): the loss, its beta and label smoothing, as TRL's DPOConfig."""

    beta: float = 0.1
    """How far the policy may move from the reference (TRL's beta; for ipo, the regularisation tau)."""

    loss_type: str = "sigmoid"
    """sigmoid (DPO) | ipo (answer-length normalised) | hinge (SLiC) | robust (rDPO, with label_smoothing)."""

    label_smoothing: float = 0.0
    """loss_type=robust: the chance a pair's preference is flipped, in [0, 0.5) (TRL's label_smoothing)."""


def check_dpo(config: DPOConfig) -> None:
    if not (math.isfinite(config.beta) and config.beta > 0):
        raise ConfigError(f"dpo.beta={config.beta!r}; use a positive number such as 0.1")
    if config.loss_type not in LOSS_TYPES:
        raise ConfigError(f"dpo.loss_type={config.loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
    if not (math.isfinite(config.label_smoothing) and 0 <= config.label_smoothing < 0.5):
        raise ConfigError(f"dpo.label_smoothing={config.label_smoothing!r}; use 0 <= label_smoothing < 0.5")
    if config.label_smoothing and config.loss_type != "robust":
        # TRL reads label_smoothing in its robust loss only: with sigmoid it would change nothing.
        raise ConfigError(f"dpo.label_smoothing={config.label_smoothing} with dpo.loss_type={config.loss_type}: "
                          "label smoothing is the robust loss's (as in TRL); use dpo.loss_type=robust or 0")
