"""Character-level text data (seed 000's CharDataset), from any fsspec URL or a built-in corpus."""

from __future__ import annotations

import importlib.util
import json
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from triax.errors import ConfigError

# The built-in corpus: the source of these standard-library modules, read from the running
# interpreter. About 1.1 MB of text (like tinyshakespeare), needs no download, and is the same on
# every run with the same Python version.
BUILTIN_MODULES = (
    "argparse", "ast", "bisect", "calendar", "csv", "dataclasses", "difflib", "email.message",
    "fnmatch", "fractions", "functools", "glob", "heapq", "http.client", "inspect", "json.decoder",
    "json.encoder", "logging", "pathlib", "random", "shlex", "statistics", "string", "textwrap",
    "tokenize", "typing",
)


def builtin_corpus() -> str:
    parts = []
    for name in BUILTIN_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # a stripped-down Python may lack a module; the rest still make a corpus
        with open(spec.origin, encoding="utf-8") as source:
            parts.append(f"# ---- {name} ----\n{source.read()}")
    return "\n".join(parts)


def read_text(path: str | None) -> str:
    """Text at an fsspec URL (local path, memory://, s3://, https://...), or the built-in corpus."""
    if not path:
        return builtin_corpus()
    import fsspec

    try:
        with fsspec.open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        raise ConfigError(f"data.path {path!r} does not exist; give an existing file or URL, "
                          "or leave data.path unset for the built-in corpus") from None
    except IsADirectoryError:
        raise ConfigError(f"data.path {path!r} is a directory; give a text file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"data.path {path!r} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not text:
        raise ConfigError(f"data.path {path!r} is empty; a character model needs text to learn from")
    return text


class Vocabulary:
    """Characters <-> integer ids; the sorted set of characters of the text."""

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "Vocabulary":
        return cls(sorted(set(text)))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return self.encode_tensor(text).tolist()

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Ids of `text`, int16 (int32 past 32767 characters). Vectorised: a per-character Python
        loop over a megabyte of text costs a noticeable part of a small run's start-up."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        points = np.array([ord(ch) for ch in self.chars], dtype=np.int64)
        lookup = np.full(int(max(points.max(initial=0), codes.max(initial=0))) + 1, -1, dtype=np.int32)
        lookup[points] = np.arange(len(points), dtype=np.int32)
        ids = lookup[codes]
        if (ids < 0).any():
            unknown = sorted(set(text) - self.stoi.keys())
            raise ConfigError(f"characters {''.join(unknown)!r} are not in the training vocabulary")
        return torch.from_numpy(ids.astype(np.int32 if len(self.chars) > 32767 else np.int16))

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_json(self) -> str:
        return json.dumps({"chars": self.chars})

    @classmethod
    def from_json(cls, text: str) -> "Vocabulary":
        return cls(json.loads(text)["chars"])


class CharDataset(Dataset):
    """Every window of `block_size + 1` characters: x is the window minus its last character,
    y the window minus its first (the next-character targets)."""

    sliding_windows = True  # a window starts at every character: evaluation takes every block_size-th

    def __init__(self, ids: torch.Tensor, block_size: int, vocab: Vocabulary):
        self.ids = ids
        self.block_size = block_size
        self.vocab = vocab
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.ids) - self.block_size

    def __getitem__(self, index: int):
        chunk = self.ids[index:index + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]

    def batch(self, indices: torch.Tensor):
        """Many samples at once by one gather: much cheaper than collating __getitem__ calls."""
        chunks = self.ids[indices[:, None] + self._offsets].long()
        return chunks[:, :-1], chunks[:, 1:]


def load_char_datasets(path: str | None, block_size: int, train_split: float = 0.9,
                       truncate: float = 1.0):
    """Train and validation CharDatasets and their vocabulary.

    Validation is the contiguous tail of the text. (Seed 000 split the *windows* at random, so a
    validation window shares all but one character with its training neighbours: its loss then
    measures memory, not generalisation.)
    """
    if not 0.0 < truncate <= 1.0:
        raise ConfigError(f"data.truncate must be in (0, 1], got {truncate}")
    if not 0.0 < train_split < 1.0:
        raise ConfigError(f"data.train_split must be in (0, 1), got {train_split}")
    text = read_text(path)
    text = text[: int(len(text) * truncate)]
    vocab = Vocabulary.from_text(text)
    ids = vocab.encode_tensor(text)
    split = int(len(ids) * train_split)
    train_ids, val_ids = ids[:split], ids[split:]
    if block_size >= min(len(train_ids), len(val_ids)):
        raise ConfigError(
            f"data.block_size={block_size} is not smaller than the text it must cut into windows "
            f"({len(train_ids)} training / {len(val_ids)} validation characters of {path or 'the built-in corpus'}); "
            "use a smaller block_size, more text, or a larger truncate")
    return CharDataset(train_ids, block_size, vocab), CharDataset(val_ids, block_size, vocab), vocab
