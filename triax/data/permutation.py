"""A seeded pseudo-random permutation of [0, n), computed one position at a time.

`randperm(n)` needs n integers of memory before the first sample is drawn: 80 GB for 10^10
windows. A Feistel network is a bijection by construction whatever its round function, so
`order[position]` can be computed from (seed, epoch, position) alone, in O(1) memory.

The network permutes [0, 4^h) with 4^h >= n (two halves of h bits each). A value that lands
outside [0, n) is sent through the network again ("cycle walking") until it lands inside; that
stays a bijection on [0, n), and as 4^h < 4n it takes under 4 passes on average.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6  # 4 already make a pseudo-random permutation (Luby-Rackoff); 6 mix small domains better
_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """A 64-bit mixing step: turns (seed, epoch, round) into independent-looking round keys."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (xor-shift / multiply), on uint64 arrays holding values < 2^32."""
    low32 = np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & low32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & low32
    return x ^ (x >> np.uint64(16))


class FeistelPermutation:
    """`permutation[positions]` for a permutation of [0, n) fixed by `key` (any integer)."""

    def __init__(self, n: int, key: int):
        if n <= 0:
            raise ValueError(f"a permutation needs a positive size, got {n}")
        if n > 1 << 62:
            raise ValueError(f"a permutation of {n} elements does not fit in int64 arithmetic")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._half_mask = np.uint64((1 << self.half_bits) - 1)
        state = _splitmix64(key & _MASK64)
        self._round_keys = []
        for _ in range(ROUNDS):
            state = _splitmix64(state)
            self._round_keys.append(np.uint64(state & 0xFFFFFFFF))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        bits = np.uint64(self.half_bits)
        left, right = x >> bits, x & self._half_mask
        for round_key in self._round_keys:
            # The round function sees the right half (< 2^32) xor'd with a 32-bit round key.
            left, right = right, left ^ (_mix32(right ^ round_key) & self._half_mask)
        return (left << bits) | right

    def __call__(self, positions: np.ndarray | int) -> np.ndarray:
        """The permuted values at `positions` (an int or an array of ints in [0, n)), as int64."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n}), got {positions.min()}..{positions.max()}")
        x = positions.astype(np.uint64)
        outside = np.ones(x.shape, dtype=bool)
        limit = np.uint64(self.n)
        while outside.any():  # cycle walking: re-encrypt only the values still outside [0, n)
            x[outside] = self._encrypt(x[outside])
            outside = x >= limit
        return x.astype(np.int64)
