"""Which windows of a held-out split an evaluation scores, so that each token counts once.

A text or token dataset has a window starting at *every* token (training wants them all), so
windows 0..B-1 overlap: scoring consecutive dataset indices scores the same few hundred tokens
up to block_size times each. An evaluation instead scores the non-overlapping windows starting at
0, T, 2T, ... (T = block_size): every target token of the split once. The tokens left over at the
end (fewer than T) are scored by one last window that ends at the last token, counting only its
positions no earlier window covered. The split's first token is never a target (nothing precedes it).

A partial evaluation (`limit` windows) takes that many of the full windows, evenly spread over the
whole split. The plan depends on the split and `limit` alone, never on the process count or the
layout, so every run scores the same tokens and its numbers stay comparable.

A dataset whose samples do not overlap (the addition task's problems) is scored sample by sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from triax.data.targets import IGNORE_INDEX

if TYPE_CHECKING:
    from torch.utils.data import Dataset


@dataclass
class WindowPlan:
    starts: torch.Tensor  # (n,) dataset indices of the windows to score
    first_scored: torch.Tensor  # (n,) the first position of each window whose target counts

    def __len__(self) -> int:
        return len(self.starts)


def evaluation_windows(dataset: Dataset, limit: int | None = None) -> WindowPlan:
    """The windows that score `dataset` once (at most `limit` of them, spread evenly; None = all)."""
    size = len(dataset)
    if not getattr(dataset, "sliding_windows", False):
        starts = torch.arange(size)
        if limit is not None and limit < size:
            starts = spread(size, limit)
        return WindowPlan(starts, torch.zeros(len(starts), dtype=torch.long))
    block = dataset.block_size
    targets = size + block - 1  # every token but the first
    full = targets // block
    leftover = targets - full * block
    if limit is not None and limit < full + (leftover > 0):
        starts = spread(full, limit) * block
        return WindowPlan(starts, torch.zeros(len(starts), dtype=torch.long))
    starts = torch.arange(full) * block
    first_scored = torch.zeros(full, dtype=torch.long)
    if leftover:
        starts = torch.cat([starts, torch.tensor([size - 1])])
        first_scored = torch.cat([first_scored, torch.tensor([block - leftover])])
    return WindowPlan(starts, first_scored)


def spread(count: int, wanted: int) -> torch.Tensor:
    """`wanted` distinct indices of 0..count-1, evenly spaced from the first."""
    return torch.arange(wanted) * count // wanted


def rank_batches(plan: WindowPlan, batch_size: int, rank: int, ranks: int):
    """This rank's share of the plan as batches of exactly `batch_size` windows (batch i of every
    rank is the plan's windows [(i*ranks + rank)*batch_size, ...)). Every rank gets the same number
    of batches, so sharded models run the same collectives everywhere; the windows that pad a
    short batch score nothing (first_scored = past the end)."""
    per_step = batch_size * ranks
    steps = max(1, -(-len(plan) // per_step))
    for step in range(steps):
        begin = step * per_step + rank * batch_size
        starts = plan.starts[begin:begin + batch_size]
        first = plan.first_scored[begin:begin + batch_size]
        missing = batch_size - len(starts)
        if missing:
            starts = torch.cat([starts, torch.zeros(missing, dtype=torch.long)])
            first = torch.cat([first, torch.full((missing,), torch.iinfo(torch.long).max)])
        yield starts, first


def mask_unscored(y: torch.Tensor, first_scored: torch.Tensor) -> torch.Tensor:
    """`y` with the targets a plan does not count set to IGNORE_INDEX."""
    positions = torch.arange(y.size(1), device=y.device)
    return y.masked_fill(positions[None, :] < first_scored.to(y.device)[:, None], IGNORE_INDEX)
