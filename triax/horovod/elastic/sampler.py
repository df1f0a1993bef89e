"""`hvd.elastic.ElasticSampler`: a DistributedSampler that survives workers coming and going.

Horovod's semantics, which its users' loops are written against: the epoch's order is
`random.Random(seed + epoch).shuffle(range(len(dataset)))` (the same on every rank), the first
`processed_num` indices of it are done, and the rest is split among the current ranks round-robin,
padded by wrapping so every rank gets the same number. `record_batch(batch_idx, batch_size)` adds
`batch_size * num_replicas` (every rank processed a batch); `set_epoch(e)` starts epoch e from
scratch. The state is just `{"epoch", "processed_num"}`: kept in a `TorchState`, it is committed,
restored and synced with the rest, so after a reset the remaining indices of the epoch are split
among the new set of ranks and nothing done is done again.
"""

from __future__ import annotations

import math
import random
from typing import Sized

import torch.utils.data

from triax.horovod import basics


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` with nothing processed. Call it at the END of an epoch (as Horovod says),
        so a reset in the middle of one does not process its samples again."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Split what is left of this epoch among the ranks there are now."""
        self.num_replicas, self.rank = basics.size(), basics.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        while indices and len(indices) < self.total_size:  # pad by wrapping around
            indices += indices[:self.total_size - len(indices)]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
