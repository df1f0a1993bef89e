"""Sample order whose position is a global sample index.

The order of samples in an epoch depends only on (seed, epoch), never on the number of processes.
A step takes the next `global_batch` positions of that order and each data-parallel rank takes its
own contiguous slice. So the position in the data is one number — the global sample index within
the epoch — and a run can resume from it exactly with 1, 2 or 4 processes.

The order is a Feistel permutation (triax.data.permutation) evaluated only at the positions a
step needs: nothing is materialised up front, so 10^10 samples cost as little as 10^3.
"""

from __future__ import annotations

import numpy as np
import torch

from triax.data.permutation import FeistelPermutation, _splitmix64


class GlobalSampler:
    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self._permutation: FeistelPermutation | None = None
        self._permutation_epoch: int | None = None
        self._order: torch.Tensor | None = None
        self._order_epoch: int | None = None

    def _epoch_permutation(self, epoch: int) -> FeistelPermutation:
        if self._permutation_epoch != epoch:
            # One key per (seed, epoch): each epoch is reshuffled, and every rank derives the same key.
            key = _splitmix64((self.seed & (2**64 - 1)) ^ _splitmix64(epoch & (2**64 - 1)))
            self._permutation = FeistelPermutation(self.num_samples, key)
            self._permutation_epoch = epoch
        return self._permutation

    def positions(self, epoch: int, start: int, count: int) -> torch.Tensor:
        """Sample ids at positions [start, start + count) of `epoch`'s order."""
        if not self.shuffle:
            return torch.arange(start, start + count)
        return torch.from_numpy(self._epoch_permutation(epoch)(range(start, start + count)))

    def at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Sample ids at any `positions` of `epoch`'s order (an int64 array)."""
        if not self.shuffle:
            return np.asarray(positions, dtype=np.int64)
        return self._epoch_permutation(epoch)(positions)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The whole order of `epoch` (O(num_samples) memory: for small datasets and tests only).
        Kept for the last epoch asked, as callers that slice it per batch ask again and again."""
        if self._order_epoch != epoch:
            self._order, self._order_epoch = self.positions(epoch, 0, self.num_samples), epoch
        return self._order

    def rank_slice(self, epoch: int, global_start: int, local_batch: int, rank: int) -> torch.Tensor:
        """The sample ids rank `rank` takes from the global batch that starts at `global_start`."""
        begin = global_start + rank * local_batch
        return self.positions(epoch, begin, max(0, min(local_batch, self.num_samples - begin)))

    def fits(self, global_start: int, global_batch: int) -> bool:
        """Whether a full global batch remains in this epoch (the ragged tail is dropped)."""
        return global_start + global_batch <= self.num_samples
