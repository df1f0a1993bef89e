"""Sample order whose position is a global sample index.

The order of samples in an epoch depends only on (seed, epoch), never on the number of processes.
A step takes the next `global_batch` indices of that order and each data-parallel rank takes its
own contiguous slice. So the position in the data is one number — the global sample index within
the epoch — and a run can resume from it exactly with 1, 2 or 4 processes.
"""

from __future__ import annotations

import torch


class GlobalSampler:
    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._cached_epoch: int | None = None
        self._cached_order: torch.Tensor | None = None

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of sample ids for `epoch` (identity when not shuffling)."""
        if self._cached_epoch != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._cached_order = torch.randperm(self.num_samples, generator=generator)
            else:
                self._cached_order = torch.arange(self.num_samples)
            self._cached_epoch = epoch
        return self._cached_order

    def rank_slice(self, epoch: int, global_start: int, local_batch: int, rank: int) -> torch.Tensor:
        """The sample ids rank `rank` takes from the global batch that starts at `global_start`."""
        begin = global_start + rank * local_batch
        return self.epoch_order(epoch)[begin:begin + local_batch]

    def fits(self, global_start: int, global_batch: int) -> bool:
        """Whether a full global batch remains in this epoch (the ragged tail is dropped)."""
        return global_start + global_batch <= self.num_samples
