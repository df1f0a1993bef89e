"""MXFP4 (the OCP microscaling format), as gpt-oss's released checkpoints store their experts'
weights: each row of a weight cut into groups of 32 values, each value a 4-bit float (E2M1: a
sign, and one of 0, 0.5, 1, 1.5, 2, 3, 4, 6) and each group sharing one power-of-two scale (E8M0:
an exponent biased by 127).

Stored as `<name>_blocks`, uint8 [..., rows, groups, 16] (two values a byte, the first in the
low nibble), and `<name>_scales`, uint8 [..., rows, groups]; the rows are the weight's output
dimension (nn.Linear's layout). Dequantized on load, exactly (every value is a small float times
a power of two, which fp32 holds exactly), as transformers' own dequantization does.
"""

from __future__ import annotations

import torch

GROUP = 32  # values sharing one scale
SCALE_BIAS = 127  # the E8M0 exponent's bias
# The E2M1 values of the 16 codes (code 8 + i is -value i).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, groups, 16] uint8 codes and [..., rows, groups] uint8 exponents -> the fp32
    weight [..., rows, groups * 32]."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int64)
    # The low nibble is the even value, the high the odd one: interleave them back.
    values = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    weight = torch.ldexp(values, exponents[..., None])
    return weight.flatten(-2)
