"""Where documents begin in a token stream, for windows whose documents never see each other
(data.packing with data.task=tokens).

A window of block_size + 1 tokens cut at any position holds the end of one document and the
start of the next. With packing, attention is confined to each document and positions restart at
each (triax.models.decoder.Packed), so the window computes what each document would alone. The
document numbers a window's positions get only need to be equal within a document and differ
across a boundary; two formats say where the boundaries are:
- a Megatron dataset's index: the first token of every document (`IndexedStarts`);
- an end-of-text token id (`EndOfText`): llm.c, modded-nanogpt and `triax tokenize` put one before
  every document, so a document begins at each (nanoGPT's prepare.py puts it after: the token
  then opens the next document instead of closing its own, which masks the same text).
"""

from __future__ import annotations

import numpy as np


class IndexedStarts:
    """Documents beginning at sorted token positions `starts` of a stream."""

    def __init__(self, starts: np.ndarray):
        self.starts = np.asarray(starts, dtype=np.int64)

    def part(self, begin: int, end: int) -> IndexedStarts:
        """The same documents in tokens [begin, end), counted from begin."""
        inside = self.starts[(self.starts >= begin) & (self.starts < end)]
        return IndexedStarts(inside - begin)

    def numbers(self, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The document number of every token at `positions` (tokens unused)."""
        return np.searchsorted(self.starts, positions, side="right")


class EndOfText:
    """Documents each beginning at the token id `token`."""

    def __init__(self, token: int):
        self.token = token

    def part(self, begin: int, end: int) -> EndOfText:
        return self

    def numbers(self, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Within each window (a row of `tokens`), a new number at every end-of-text token."""
        return np.cumsum(tokens == self.token, axis=1)
