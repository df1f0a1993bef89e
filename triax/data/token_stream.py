"""Token ids of one or more files, memory-mapped and read as one array.

A source in Megatron's or llm.c's format is a set of binary files whose headers say where the
tokens are; once a reader has checked those headers, the tokens are a plain array at some byte
offset of each file. `TokenStream` joins such arrays end to end (llm.c's shards of one corpus are
one stream) and hands out windows that may cross from one file into the next. Nothing is read
until a window asks for it: the OS pages in what a batch touches.
"""

from __future__ import annotations

import numpy as np

from triax import safe_files
from triax.data.errors import DataError


def open_data_file(path: str):
    """`path` opened for reading: a regular file, not through a link (triax.safe_files), or one line."""
    try:
        return safe_files.open_read(path)
    except safe_files.UnsafeFileError:
        raise
    except OSError as error:
        raise DataError(f"{path!r} cannot be read: {error.strerror or error}") from None


def map_tokens(path: str, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    """`count` tokens of `dtype` at byte `offset` of the regular file `path`, memory-mapped.
    Opened without following a link (triax.safe_files); the caller has checked the size."""
    if count == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses an empty map
    with open_data_file(path) as handle:
        return np.memmap(handle, dtype=dtype, mode="r", offset=offset, shape=(count,))


def file_size(path: str) -> int:
    """The size of the regular file `path` (no link, FIFO or directory: one line otherwise)."""
    with open_data_file(path) as handle:
        return handle.seek(0, 2)


class TokenStream:
    """Tokens [begin, begin + num_tokens) of arrays read end to end. `path` names the stream in
    messages (a file, a prefix or a glob)."""

    def __init__(self, arrays: list[np.ndarray], path: str, begin: int = 0, num_tokens: int | None = None):
        self.arrays = arrays
        self.path = path
        self.offsets = np.concatenate([[0], np.cumsum([len(array) for array in arrays])]).astype(np.int64)
        self.begin = begin
        self.num_tokens = int(self.offsets[-1]) - begin if num_tokens is None else num_tokens
        self.dtype = arrays[0].dtype if arrays else np.dtype("uint16")

    def part(self, begin: int, end: int) -> TokenStream:
        """Tokens [begin, end) of this stream, as a stream of its own (a split)."""
        if not 0 <= begin <= end <= self.num_tokens:
            raise DataError(f"{self.path!r}: tokens [{begin}, {end}) are outside its {self.num_tokens}")
        return TokenStream(self.arrays, self.path, self.begin + begin, end - begin)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) token ids, window i beginning at token starts[i] of this stream."""
        positions = self.begin + np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)
        if len(self.arrays) == 1:
            return np.asarray(self.arrays[0][positions])
        out = np.empty(positions.shape, dtype=self.dtype)
        owner = np.searchsorted(self.offsets, positions, side="right") - 1
        for index in np.unique(owner):  # a window may run from one file into the next
            here = owner == index
            out[here] = self.arrays[index][positions[here] - self.offsets[index]]
        return out
