"""torch.compile, block by block.

Compiling each transformer block (rather than the whole model) keeps the graphs small and
identical, so one compilation serves every layer, and leaves the FSDP hooks between blocks
outside the graphs. `nn.Module.compile()` compiles in place: parameter names keep no `_orig_mod`.
"""

from __future__ import annotations

import torch.nn as nn


def apply_compile(model: nn.Module) -> nn.Module:
    for block in model.layers.values():
        block.compile()
    return model
