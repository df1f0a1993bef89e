"""YaRN's rotary scaling as DeepSeek-V3 and Kimi K2 are released with it (model.rope_scaling=yarn):
the rotary frequencies interpolated by rope_factor where a pair turns fewer than rope_beta_slow
times over the original context (rope_original_context), kept where it turns more than
rope_beta_fast times, ramped between (the ramp's bounds rounded to whole pairs with rope_truncate);
and, as DeepSeek scales the softmax of every query/key value by YaRN's mscale twice (transformers'
mscale_all_dim), the softmax scale multiplied by (0.1 ln(rope_factor) + 1)^2. The gain of the rotary
cos and sin, mscale / mscale_all_dim, is 1: the released configs give both as 1, the only values
read. (gpt_oss/model.py computes the same frequencies over a whole head; here they are of the
qk_rope_head_dim rotary values only.)"""

from __future__ import annotations

import math

import torch

from triax.models.config import GPTConfig


def mscale(factor: float) -> float:
    """YaRN's attention temperature for a context stretched `factor` times: 0.1 ln(factor) + 1."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_factor(config: GPTConfig) -> float:
    """What the softmax scale 1/sqrt(query/key head width) is multiplied by."""
    return mscale(config.rope_factor) ** 2 if config.rope_scaling == "yarn" else 1.0


def yarn_inverse_frequencies(config: GPTConfig, dim: int) -> torch.Tensor:
    """The inverse frequencies of `dim` rotary values, interpolated as YaRN does (fp32, on the CPU
    whatever the default device: a model built on the meta device still needs its tables)."""
    base, factor, context = config.rope_theta, config.rope_factor, config.rope_original_context
    frequencies = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)

    def pair_turning(rotations: float) -> float:  # the pair that turns `rotations` times over the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(config.rope_beta_fast), pair_turning(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    kept = 1 - ramp  # 1: the original frequency (extrapolated), 0: interpolated
    return (1.0 / (factor * frequencies)) * (1 - kept) + (1.0 / frequencies) * kept
