"""How a prepared dataloader's batches are shared out among processes, as Accelerate shares them.

Accelerate's rule for map-style data is "deal the DataLoader's own batches": the batches the user's
batch sampler yields (batch size B) are dealt out in turn, batch k*N + r to process r of N. So N
processes with batch B step through exactly the samples one process sees with batch N*B, in the
same order, and the order itself is the user's sampler's (drawn alike on every process: see
triax/accelerate/data_loader.py). With split_batches each batch is cut into N pieces instead. A stream (an
IterableDataset) is read by every process and cut the same way, sample by sample.

The tail of a pass is where the rules differ: with even_batches (the default) the last, incomplete
round is filled with indices from the start of the pass, so every process takes as many batches,
all full; without it, some processes get one batch fewer (or a short one). The batch counts and
the filling follow Accelerate 1.15 exactly, since they decide which sample each step sees.
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler

from triax.accelerate._internal.errors import AcceleratorValueError
from triax.data.sampler import GlobalSampler


class BatchSamplerShard(BatchSampler):
    """Process `process_index`'s share of `batch_sampler`'s batches (Accelerate's class of the same
    name). `batch_size` and `drop_last` are read from the inner sampler; a sampler without a
    batch_size yields batches of any size (dealt out whole, never split)."""

    def __init__(self, batch_sampler: torch.utils.data.BatchSampler, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True):
        # BatchSampler.__init__ is not called: its checks are for a sampler of indices.
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes):
            raise AcceleratorValueError(f"split_batches needs the batch size ({self.batch_size}) to be a round "
                                        f"multiple of the number of processes ({num_processes})")

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        batches = len(self.batch_sampler)
        if self.split_batches:
            return batches
        rounds, rest = divmod(batches, self.num_processes)
        if not rest or self.drop_last:
            return rounds
        if self.even_batches:
            return rounds + 1
        return rounds + (1 if self.process_index < rest else 0)

    def __iter__(self):
        return self._split() if self.split_batches else self._deal()

    def _deal(self):
        count, me, size = self.num_processes, self.process_index, self.batch_size
        keep_tail = not self.drop_last
        start = []  # the pass's first `count` batches: what an incomplete last round is filled from
        mine = None  # this process's batch of the round being collected
        index, batch = -1, []
        for index, batch in enumerate(self.batch_sampler):
            if keep_tail and index < count:
                if size is None:
                    start.append(batch)
                else:
                    start += batch
            if index % count == me:
                mine = batch
            # A round is handed out once it is complete and its last batch full: every process
            # then steps together.
            if index % count == count - 1 and (size is None or len(batch) == size):
                yield mine
                mine = None
        if not keep_tail or not start:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if mine and (size is None or len(mine) == size):
            yield mine
        # Fill the last round from the start of the pass (cycled when the pass is shorter than
        # one round), so every process gets the same number of batches, all of full size.
        needed = count * size if size is not None else count
        while len(start) < needed:
            start += start
        if size is None or len(batch) == size:
            batch, index = [], index + 1  # the last batch was handed out: fill from the next one
        cursor = 0
        while index % count or batch:
            if size is None:
                batch = start[cursor]
                cursor += 1
            else:
                end = cursor + size - len(batch)
                batch = list(batch) + start[cursor:end]
                cursor = end
            if index % count == me:
                yield batch
            batch, index = [], index + 1

    def _split(self):
        piece = self.batch_sampler.batch_size // self.num_processes
        begin, end = piece * self.process_index, piece * (self.process_index + 1)
        first, batch = [], []
        for index, batch in enumerate(self.batch_sampler):
            if index == 0:
                first = batch
            if len(batch) == self.batch_size:
                yield batch[begin:end]
        if self.drop_last or not first or len(batch) >= self.batch_size:
            return
        if not self.even_batches:
            if len(batch) > begin:
                yield batch[begin:end]
            return
        while len(first) < self.batch_size:  # a pass shorter than one batch
            first = first + first
        yield (list(batch) + list(first))[begin:end]


class IterableDatasetShard(IterableDataset):
    """Process `process_index`'s samples of a stream (Accelerate's class of the same name): the
    stream is read in global batches (batch_size x num_processes, or batch_size with
    split_batches) and each process takes its contiguous slice of each. Unless drop_last, the last
    global batch is filled with samples from the first one."""

    def __init__(self, dataset: torch.utils.data.Dataset, batch_size: int = 1, drop_last: bool = False,
                 num_processes: int = 1, process_index: int = 0, split_batches: bool = False):
        if split_batches and batch_size > 1 and batch_size % num_processes:
            raise AcceleratorValueError(f"split_batches needs the batch size ({batch_size}) to be a round multiple "
                                        f"of the number of processes ({num_processes})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        global_batch = self.batch_size * self.num_processes
        if self.drop_last:
            return (len(self.dataset) // global_batch) * self.batch_size
        return -(-len(self.dataset) // global_batch) * self.batch_size

    def __iter__(self):
        # A stream that shuffles with a generator of its own but cannot be told the epoch is
        # reseeded with it, so every process reads the same stream.
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        global_batch = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        per_process = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        mine = range(self.process_index * per_process, (self.process_index + 1) * per_process)
        first, current = None, []
        for sample in self.dataset:
            current.append(sample)
            if len(current) == global_batch:
                for position in mine:
                    yield current[position]
                if first is None:
                    first = list(current)
                current = []
        if self.drop_last or not current:
            return
        if first is None:
            first = list(current)
        while len(current) < global_batch:
            current += first
        for position in mine:
            yield current[position]


class SkipBatchSampler(BatchSampler):
    """The batches of `batch_sampler` after the first `skip_batches` (Accelerate's class)."""

    def __init__(self, batch_sampler: torch.utils.data.BatchSampler, skip_batches: int = 0):
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    def __iter__(self):
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.skip_batches:
                yield batch

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return len(self.batch_sampler) - self.skip_batches


class SeededOrderSampler(Sampler):
    """triax's data_order="seeded": epoch e's order is the permutation of (seed, e) from
    triax.data.sampler.GlobalSampler, computed a slice at a time (no generator, nothing drawn, the
    same on every process). The prepared dataloader tells it the epoch before each pass."""

    SLICE = 4096  # positions computed at once: memory stays O(SLICE) at any dataset size

    def __init__(self, num_samples: int, seed: int):
        self.order = GlobalSampler(max(num_samples, 1), seed, shuffle=True)
        self.num_samples = num_samples
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        for start in range(0, self.num_samples, self.SLICE):
            yield from self.order.positions(self.epoch, start, min(self.SLICE, self.num_samples - start)).tolist()
