"""YaRN's rotary frequencies (Peng et al. 2023), shared by the families that scale their rotary
positions with it (model.rope_scaling=yarn): gpt-oss over a whole head, DeepSeek-V3 over its
qk_rope_head_dim rotary values. A leaf: it reads the config's fields and imports no family."""

from __future__ import annotations

import math

import torch

from triax.models.config import GPTConfig


def mscale(factor: float) -> float:
    """YaRN's attention temperature for a context stretched `factor` times: 0.1 ln(factor) + 1."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_inverse_frequencies(config: GPTConfig, dim: int) -> torch.Tensor:
    """The inverse frequencies of `dim` rotary values: a pair turning fewer than rope_beta_slow times
    over the original context (rope_original_context) is interpolated (divided by rope_factor), one
    turning more than rope_beta_fast times kept, a linear ramp between (its bounds rounded to whole
    pairs with rope_truncate). fp32, on the CPU whatever the default device: a model built on the
    meta device still needs its tables."""
    base, factor, context = config.rope_theta, config.rope_factor, config.rope_original_context
    frequencies = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)

    def pair_turning(rotations: float) -> float:  # the pair that turns `rotations` times over the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(config.rope_beta_fast), pair_turning(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low if high != low else 0.001)).clamp(0, 1)  # a zero-width ramp: a step
    kept = 1 - ramp  # 1: the original frequency (extrapolated), 0: interpolated
    return (1.0 / (factor * frequencies)) * (1 - kept) + (1.0 / frequencies) * kept
