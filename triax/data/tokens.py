"""Token files in nanoGPT's layout: a directory with train.bin and val.bin (flat arrays of token
ids) and an optional meta.json ({"vocab_size": N, "dtype": "uint16", "tokenizer": "tokenizer.json"}).

Nothing reads a whole file: a local file is memory-mapped (the OS pages in the windows a batch
touches), a remote one (any fsspec URL) is read one window at a time by byte range. A sample is a
window of block_size + 1 tokens starting at any token, as in nanoGPT.
"""

from __future__ import annotations

import json
import os
import posixpath
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from triax import safe_files
from triax.data.targets import IGNORE_INDEX
from triax.data.errors import DataError
from triax.models.config import MAX_SIZES, SIZE_REASON

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
META_FILE = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
# Windows checked for out-of-range ids when a file is opened (every batch is checked again on read).
CHECKED_WINDOWS = 64


class TokenFile:
    """A flat array of token ids at `path` (local path or fsspec URL), read by ranges."""

    def __init__(self, fs: AbstractFileSystem, path: str, dtype: str, local: bool):
        self.path = path
        self.dtype = np.dtype(dtype)
        size = fs.size(path)
        if size % self.dtype.itemsize:
            raise DataError(f"{path!r} is {size} bytes, not a whole number of {dtype} tokens "
                              f"({self.dtype.itemsize} bytes each); is data.token_dtype (or meta.json's dtype) right?")
        self.num_tokens = size // self.dtype.itemsize
        self._fs = fs
        # np.memmap of an empty file fails; such a file is reported as too short by the caller.
        self._array = np.memmap(path, dtype=self.dtype, mode="r") if local and self.num_tokens else None

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) token ids, window i beginning at token starts[i]."""
        if self._array is not None:
            return np.asarray(self._array[starts[:, None] + np.arange(length)])
        size = self.dtype.itemsize
        byte_starts = [int(start) * size for start in starts]
        # One ranged read per window; cat_ranges lets async filesystems (s3, gcs, http) run them concurrently.
        chunks = self._fs.cat_ranges([self.path] * len(byte_starts), byte_starts,
                                     [start + length * size for start in byte_starts])
        return np.stack([np.frombuffer(chunk, dtype=self.dtype) for chunk in chunks])


class TokenDataset(Dataset):
    """Every window of `block_size + 1` tokens of one token file (or of a TokenStream, which
    reads the same way: triax.data.token_stream): x is the window less its last
    token, y the window less its first. With `documents` (triax.data.documents) and `packing`,
    each position also has a document number (document_ids) that confines its attention; unless
    `score_document_starts`, a target that begins another document than its position's is not
    scored."""

    sliding_windows = True  # a window starts at every token: evaluation takes every block_size-th

    def __init__(self, tokens: TokenFile, block_size: int, vocab_size: int, documents: object | None = None):
        self.tokens = tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.documents = documents
        self.packing = False
        self.score_document_starts = True

    def __len__(self) -> int:
        return self.tokens.num_tokens - self.block_size

    def _windows(self, starts: np.ndarray) -> np.ndarray:
        chunks = self.tokens.windows(starts, self.block_size + 1)
        # Checked on every read, so a bad id is reported where it is rather than crashing an
        # embedding lookup (or, on a GPU, corrupting memory).
        if chunks.size and (chunks.max() >= self.vocab_size or chunks.min() < 0):
            bad = chunks.max() if chunks.max() >= self.vocab_size else chunks.min()
            row = int(np.argwhere(chunks == bad)[0][0])
            raise DataError(f"token id {int(bad)} in {self.tokens.path!r} (window at token {int(starts[row])}) "
                              f"is outside the vocabulary [0, {self.vocab_size}); set data.vocab_size (or "
                              "meta.json's vocab_size) to the tokenizer's size, or check data.token_dtype")
        return chunks.astype(np.int64)

    def _document_numbers(self, starts: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        positions = starts[:, None] + np.arange(self.block_size + 1)
        return self.documents.numbers(positions, chunks)

    def batch(self, indices: torch.Tensor):
        starts = np.asarray(indices, dtype=np.int64).reshape(-1)
        chunks = self._windows(starts)
        x, y = torch.from_numpy(chunks[:, :-1]), torch.from_numpy(chunks[:, 1:].copy())
        if self.packing and not self.score_document_starts:
            numbers = self._document_numbers(starts, chunks)
            y[torch.from_numpy(numbers[:, 1:] != numbers[:, :-1])] = IGNORE_INDEX
        return x, y

    def document_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """(len(indices), block_size) the document number of each input position."""
        starts = np.asarray(indices, dtype=np.int64).reshape(-1)
        return torch.from_numpy(self._document_numbers(starts, self._windows(starts))[:, :-1].astype(np.int64))

    def __getitem__(self, index: int):
        x, y = self.batch(torch.tensor([index]))
        return x[0], y[0]

    def check_sample(self) -> None:
        """Read a few windows spread over the file (the same on every rank): a file of the wrong
        dtype or vocabulary usually fails here, before any process group exists."""
        count = min(CHECKED_WINDOWS, len(self))
        self._windows(np.unique(np.linspace(0, len(self) - 1, count).astype(np.int64)))


def read_token_meta(fs: AbstractFileSystem, directory: str) -> dict | None:
    path = posixpath.join(directory, META_FILE)
    local = "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))
    if not (os.path.lexists(path) if local else fs.exists(path)):
        return None
    try:
        # No link, FIFO or huge file: meta.json is a few bytes (safe_files' cap).
        location = path if local else fs.unstrip_protocol(path)
        meta = json.loads(safe_files.read_location(location).decode("utf-8"))
    except OSError as error:
        raise DataError(f"{path!r} cannot be read: {error}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{path!r} is not valid JSON ({error}); fix or delete it") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path!r} must hold a JSON object like "
                          '{"vocab_size": 50304, "dtype": "uint16"}, got ' + type(meta).__name__)
    vocab_size = meta.get("vocab_size")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                   or not 0 < vocab_size <= MAX_SIZES["vocab_size"]):
        raise DataError(f"{path!r}: vocab_size must be an integer 1 .. {MAX_SIZES['vocab_size']} ({SIZE_REASON}), "
                        f"got {vocab_size!r}")
    tokenizer = meta.get("tokenizer")
    if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer
                                  or "/" in tokenizer or "\\" in tokenizer or tokenizer in (".", "..")):
        raise DataError(f"{path!r}: tokenizer must be the name of a file beside it, got {tokenizer!r}")
    return meta


def resolve_token_settings(fs: AbstractFileSystem, directory: str, vocab_size: int | None, token_dtype: str | None):
    """(vocab_size, dtype, tokenizer path or None) from meta.json and the config, which must agree."""
    meta = read_token_meta(fs, directory)
    if meta is None:
        if vocab_size is None:
            pickle_note = ""
            if fs.exists(posixpath.join(directory, "meta.pkl")):
                pickle_note = (" (its meta.pkl is a pickle, which triax never reads: it can run code; "
                               "`triax tokenize` writes meta.json)")
            raise DataError(f"data.path {directory!r} has no meta.json{pickle_note}; set data.vocab_size "
                              "(and data.token_dtype if not uint16), e.g. data.vocab_size=50304 for GPT-2 tokens")
        meta = {}
    meta_vocab, meta_dtype = meta.get("vocab_size"), meta.get("dtype")
    # A larger data.vocab_size pads the embedding (nanoGPT rounds GPT-2's 50257 up to 50304 for speed).
    if vocab_size is not None and meta_vocab is not None and vocab_size < meta_vocab:
        raise DataError(f"data.vocab_size={vocab_size} is smaller than {directory}/meta.json's vocab_size "
                          f"{meta_vocab}; leave data.vocab_size unset or make it at least {meta_vocab}")
    if token_dtype is not None and meta_dtype is not None and token_dtype != meta_dtype:
        raise DataError(f"data.token_dtype={token_dtype} but {directory}/meta.json says {meta_dtype}; "
                          "leave data.token_dtype unset or make them agree")
    vocab_size = vocab_size if vocab_size is not None else meta_vocab
    if vocab_size is None:
        raise DataError(f"{directory}/meta.json has no vocab_size; add it or set data.vocab_size")
    dtype = token_dtype or meta_dtype or "uint16"
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"token dtype {dtype!r} is not supported; use one of {', '.join(TOKEN_DTYPES)}")
    if np.iinfo(np.dtype(dtype)).max < vocab_size - 1 and dtype != "int64":
        raise DataError(f"vocab_size {vocab_size} does not fit in {dtype} token ids; use a wider data.token_dtype")
    tokenizer = None
    if meta.get("tokenizer"):
        tokenizer = posixpath.join(directory, meta["tokenizer"])
        if not fs.exists(tokenizer):
            raise DataError(f"{directory}/meta.json names tokenizer {meta['tokenizer']!r} but {tokenizer!r} "
                              "does not exist; copy it there or remove the entry")
    return vocab_size, dtype, tokenizer


def load_token_datasets(path: str | None, block_size: int, vocab_size: int | None = None,
                        token_dtype: str | None = None):
    """Train and validation TokenDatasets of a token directory, its vocabulary size and the
    tokenizer file it names (or None)."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    if not path:
        raise DataError("data.task=tokens needs data.path: a directory with train.bin and val.bin "
                          "(make one with `triax tokenize`)")
    if vocab_size is not None and vocab_size <= 0:
        raise DataError(f"data.vocab_size must be positive, got {vocab_size}")
    fs, directory = fsspec.core.url_to_fs(path)
    directory = directory.rstrip("/") or directory
    if not fs.isdir(directory):
        what = "is a file" if fs.exists(directory) else "does not exist"
        raise DataError(f"data.path {path!r} {what}; data.task=tokens needs a directory with train.bin and val.bin")
    missing = [name for name in SPLIT_FILES.values() if not fs.isfile(posixpath.join(directory, name))]
    if missing:
        raise DataError(f"data.path {path!r} has no {' or '.join(missing)}; a token directory holds "
                          "train.bin and val.bin (nanoGPT's layout; `triax tokenize` writes one)")
    vocab_size, dtype, tokenizer = resolve_token_settings(fs, directory, vocab_size, token_dtype)
    local = isinstance(fs, LocalFileSystem)
    datasets = []
    for split, name in SPLIT_FILES.items():
        tokens = TokenFile(fs, posixpath.join(directory, name), dtype, local)
        if tokens.num_tokens <= block_size:
            raise DataError(f"{tokens.path!r} holds {tokens.num_tokens} tokens, too few for one window of "
                              f"data.block_size + 1 = {block_size + 1}; use a smaller block_size or more data")
        dataset = TokenDataset(tokens, block_size, vocab_size)
        dataset.check_sample()
        datasets.append(dataset)
    train, val = datasets
    if tokenizer is not None and not local:
        tokenizer = fs.unstrip_protocol(tokenizer)  # a URL again, so fsspec.open finds the same store
    return train, val, vocab_size, tokenizer
