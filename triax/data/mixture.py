"""Weighted mixtures of token sources, blended as Megatron-LM's BlendedDataset blends them.

Sample i of a mixture comes from the source furthest behind its weight: the source s with the
largest error w_s * max(i, 1) - n_s, where n_s counts the samples s gave before i and the weights
are normalised to sum to 1 (the first source wins a tie; megatron-core's helpers.cpp,
build_blending_indices). So each source's share follows its weight at every prefix of the run,
within about one sample per source, not only on average. The j-th sample a source gives is its
window at position j of the source's own seeded permutation (triax.data.sampler), reshuffled
every epoch.

An epoch of the mixture is as long as its sources allow without a window drawn twice: min over s
of len_s / w_s samples (the one source the blend reaches first may give one window twice at the
epoch's end). The sampler's place stays one number, the global sample index within the epoch: the
blend is a pure function of it, so a resumed run, and any number of processes, read the same
samples. The blend is computed the first time a position is needed and remembered in chunks
(the counts at every CHUNK-th sample, so O(samples / CHUNK) memory): reading on costs a few
microseconds per sample, a resume at sample P recomputes the P samples before it once.
"""

from __future__ import annotations

import numpy as np
import torch

from triax.data.errors import DataError
from triax.data.permutation import _splitmix64
from triax.data.sampler import GlobalSampler

CHUNK = 4096  # samples blended at a time: one chunk is a few milliseconds of blending


def normalised_weights(weights: list[float], names: list[str]) -> np.ndarray:
    """The weights divided by their sum (as Megatron does), each checked to be a positive number."""
    for weight, name in zip(weights, names):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
            raise DataError(f"source {name!r} has weight {weight!r}; every weight must be a positive number "
                            "(remove a source rather than giving it weight 0)")
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


class BlendOrder:
    """Which source each sample of an epoch comes from, and its rank among that source's samples."""

    def __init__(self, weights: np.ndarray):
        self.weights = [float(weight) for weight in weights]
        self._chunk_counts = [[0] * len(self.weights)]  # samples given by each source before chunk k
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    def _blend(self, first: int, count: int, counts: list[int]) -> tuple[list[int], list[int]]:
        """Samples [first, first + count) from the counts before `first` (updated in place)."""
        weights, sources, drawn = self.weights, [0] * count, [0] * count
        for offset in range(count):
            position = float(max(first + offset, 1))  # Megatron's max(i, 1): sample 0 weighs like sample 1
            best, best_error = 0, weights[0] * position - counts[0]
            for source in range(1, len(weights)):
                error = weights[source] * position - counts[source]
                if error > best_error:
                    best, best_error = source, error
            sources[offset], drawn[offset] = best, counts[best]
            counts[best] += 1
        return sources, drawn

    def _chunk(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is not None and self._cached[0] == number:
            return self._cached[1], self._cached[2]
        while len(self._chunk_counts) <= number:  # the counts at each chunk start up to this one
            counts = list(self._chunk_counts[-1])
            self._blend((len(self._chunk_counts) - 1) * CHUNK, CHUNK, counts)
            self._chunk_counts.append(counts)
        sources, drawn = self._blend(number * CHUNK, CHUNK, list(self._chunk_counts[number]))
        self._cached = (number, np.asarray(sources, dtype=np.int64), np.asarray(drawn, dtype=np.int64))
        return self._cached[1], self._cached[2]

    def at(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank within the source) of samples [start, start + count)."""
        parts = []
        position, end = start, start + count
        while position < end:
            number = position // CHUNK
            sources, drawn = self._chunk(number)
            stop = min(end, (number + 1) * CHUNK)
            parts.append((sources[position - number * CHUNK:stop - number * CHUNK],
                          drawn[position - number * CHUNK:stop - number * CHUNK]))
            position = stop
        if not parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate([part[0] for part in parts]), np.concatenate([part[1] for part in parts])


class Mixture:
    """Training windows of several token sources: sample ids are positions in the sources read
    end to end (source s's window w is id offsets[s] + w), as BlendedSampler hands them out."""

    def __init__(self, sources: list, weights: list[float], names: list[str]):
        self.sources, self.names = sources, names
        self.weights = normalised_weights(weights, names)
        self.block_size = sources[0].block_size
        lengths = np.array([len(source) for source in sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.epoch_samples = int(min(length / weight for length, weight in zip(lengths, self.weights)))
        self.packing = False  # data.packing: the sources' windows carry document numbers

    def _by_source(self, indices: torch.Tensor):
        """(source number, rows of `indices`, the source's own ids) for each source they touch."""
        ids = np.asarray(indices, dtype=np.int64).reshape(-1)
        owner = np.searchsorted(self.offsets, ids, side="right") - 1
        for source in np.unique(owner):
            here = np.flatnonzero(owner == source)
            yield source, here, torch.from_numpy(ids[here] - self.offsets[source])

    def __len__(self) -> int:
        return self.epoch_samples

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.empty((len(indices), self.block_size), dtype=torch.int64)
        y = torch.empty_like(x)
        for source, rows, ids in self._by_source(indices):
            x[rows], y[rows] = self.sources[source].batch(ids)
        return x, y

    def document_ids(self, indices: torch.Tensor) -> torch.Tensor:
        documents = torch.empty((len(indices), self.block_size), dtype=torch.int64)
        for source, rows, ids in self._by_source(indices):
            documents[rows] = self.sources[source].document_ids(ids)
        return documents

    def __getitem__(self, index: int):
        x, y = self.batch(torch.tensor([index]))
        return x[0], y[0]


class BlendedSampler(GlobalSampler):
    """The mixture's order: position i of an epoch is the blend's i-th sample (Megatron's rule),
    drawn from its source's own permutation. Positions, epochs and rank slices are GlobalSampler's."""

    def __init__(self, mixture: Mixture, seed: int, shuffle: bool = True):
        super().__init__(len(mixture), seed, shuffle)
        self.mixture = mixture
        self.blend = BlendOrder(mixture.weights)
        # Each source its own order, from a seed of its own (the same on every rank).
        self.source_orders = [GlobalSampler(len(source), _splitmix64((seed ^ _splitmix64(number + 1)) & (2**64 - 1)),
                                            shuffle) for number, source in enumerate(mixture.sources)]

    def positions(self, epoch: int, start: int, count: int) -> torch.Tensor:
        sources, drawn = self.blend.at(start, count)
        ids = np.empty(len(sources), dtype=np.int64)
        for source in np.unique(sources):
            here = sources == source
            order = self.source_orders[source]
            ids[here] = self.mixture.offsets[source] + order.at(epoch, drawn[here] % order.num_samples)
        return torch.from_numpy(ids)


def sampler_for(dataset: object, seed: int, shuffle: bool) -> GlobalSampler:
    """The data order of a training set: a mixture's blend, else GlobalSampler's permutation."""
    if isinstance(dataset, Mixture):
        return BlendedSampler(dataset, seed, shuffle)
    return GlobalSampler(len(dataset), seed, shuffle)
