"""The dpo.* keys: Direct Preference Optimization (Rafailov et al. 2023) on data.task=preference,
named and defined as TRL's DPOConfig names and defines them (docs/preference.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from triax.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
# dpo.beta's range: sigmoid, hinge and robust scale the log-probability margin by beta (a sequence's
# margin reaches thousands of nats: beta 1e300 makes it inf in float32), ipo's target margin is
# 1/(2 beta), squared (beta 1e-320 makes it inf). Within [1e-6, 1e6] both stay below 1e13, finite in
# float32 and bfloat16 alike, and the range holds every beta the DPO papers and TRL use (0.01 .. 1).
BETA_RANGE = (1e-6, 1e6)


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
    if not (math.isfinite(config.beta) and BETA_RANGE[0] <= config.beta <= BETA_RANGE[1]):
        raise ConfigError(f"dpo.beta={config.beta!r}; use a number in [{BETA_RANGE[0]:g}, {BETA_RANGE[1]:g}] such as "
                          "0.1 (beyond it the loss's arithmetic overflows)")
    if config.loss_type not in LOSS_TYPES:
        raise ConfigError(f"dpo.loss_type={config.loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
    if not (math.isfinite(config.label_smoothing) and 0 <= config.label_smoothing < 0.5):
        raise ConfigError(f"dpo.label_smoothing={config.label_smoothing!r}; use 0 <= label_smoothing < 0.5")
    if config.label_smoothing and config.loss_type != "robust":
        # TRL reads label_smoothing in its robust loss only: with sigmoid it would change nothing.
        raise ConfigError(f"dpo.label_smoothing={config.label_smoothing} with dpo.loss_type={config.loss_type}: "
                          "label smoothing is the robust loss's (as in TRL); use dpo.loss_type=robust or 0")


def check_preference_run(config: Any, layout: Any) -> None:
    """What a DPO run needs, before any process group forms (one line each). `config`: the
    TrainConfig; `layout`: its parallel.mesh.Layout (names for the types alone would make a circle:
    the schema imports this module)."""
    if config.data.task != "preference":
        return  # dpo.* keys set on another task are refused with every objective's (validate.check_sections_apply)
    if not config.model.lora.rank and not config.model.init_from:
        raise ConfigError("data.task=preference needs model.init_from: the reference is the model it starts from")
    check_layout(layout)
    if config.data.packing:
        raise ConfigError("data.packing=true does not apply to data.task=preference: each batch is padded to its "
                          "longest sequence; use data.packing=false")


def check_layout(layout: Any) -> None:
    """The layouts DPO cannot run under (a parallel.mesh.Layout)."""
    if layout.pp > 1:
        raise ConfigError(f"data.task=preference does not run under pipeline parallelism (parallel.pp={layout.pp}): "
                          "a pair's two answers and both forwards must stay on one stage; use dp_shard or tp")
    if layout.cp > 1:
        raise ConfigError(f"data.task=preference does not run under context parallelism (parallel.cp={layout.cp}): "
                          "each answer's log-probability is summed over its whole sequence; use parallel.cp=1")
