"""What a family's adapter to another tool's checkpoint (its hf.py) and the reader of the files
(triax/interop/hf/) share, so that the adapter lives in its family's folder without importing the
reader: where a parameter is stored (`Source`), the slot of an expert's number in a stored name,
the error of a checkpoint triax cannot read, and the reader's interface (`StoredWeights`)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from triax.errors import ConfigError

# Where an expert's number goes in the stored name of a stack of experts' tensors (models/moe/hf.py).
EXPERT_SLOT = "{expert}"


class CheckpointError(ConfigError, ValueError):
    """A model.init_from checkpoint that is missing, of an architecture triax does not build, or not
    readable safely."""


class Source(NamedTuple):
    """Where a triax parameter's values are stored in a checkpoint."""

    name: str
    transposed: bool = False  # stored (in, out), as GPT-2's Conv1D
    offset: int = 0  # where ours start along the stored output dimension (a slice of a fused tensor)
    fused: bool = False  # the stored tensor holds other parameters too (GPT-2's c_attn: q, k and v)


class StoredWeights(Protocol):
    """A checkpoint's tensors as triax/interop/hf/files.py's HFWeights serves them."""

    def prefix(self, anchor: str, prefixes: tuple[str, ...]) -> str: ...

    def has(self, name: str) -> bool: ...

    def entry(self, name: str) -> tuple: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor: ...
