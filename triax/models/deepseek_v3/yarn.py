"""YaRN's rotary scaling as DeepSeek-V3 and Kimi K2 are released with it (model.rope_scaling=yarn):
the rotary frequencies interpolated by rope_factor where a pair turns fewer than rope_beta_slow
times over the original context (rope_original_context), kept where it turns more than
rope_beta_fast times, ramped between (the ramp's bounds rounded to whole pairs with rope_truncate);
and, as DeepSeek scales the softmax of every query/key value by YaRN's mscale twice (transformers'
mscale_all_dim), the softmax scale multiplied by (0.1 ln(rope_factor) + 1)^2. The gain of the rotary
cos and sin, mscale / mscale_all_dim, is 1: the released configs give both as 1, the only values
read. (The frequencies are triax/models/rotary.py's, which gpt-oss computes over a whole head; here
they are of the qk_rope_head_dim rotary values only.)"""

from __future__ import annotations

from triax.models.config import GPTConfig
from triax.models.rotary import mscale, yarn_inverse_frequencies

__all__ = ["mscale", "softmax_factor", "yarn_inverse_frequencies"]


def softmax_factor(config: GPTConfig) -> float:
    """What the softmax scale 1/sqrt(query/key head width) is multiplied by."""
    return mscale(config.rope_factor) ** 2 if config.rope_scaling == "yarn" else 1.0
