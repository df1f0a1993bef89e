"""llm.c's and modded-nanogpt's token shards (FineWeb's 100M-token `fineweb_train_000001.bin` ...).

Each shard is a header of 256 little-endian int32 — [0] the magic 20240520, [1] the version (1:
GPT-2's uint16 tokens; 2: llm.c's uint32 tokens for Llama 3), [2] the number of tokens — then the
tokens themselves. A glob names many shards; sorted by name they are one stream, as the writers
number them. Documents are not indexed: each begins with the end-of-text token (GPT-2's 50256)
the writers put before it. Every header is checked when the shards are opened, and a shard whose
header lies (magic, version, a count its size does not hold) is refused with one line naming it.
"""

from __future__ import annotations

import glob
import os

import numpy as np

from triax import safe_files
from triax.data.errors import DataError
from triax.data.token_stream import TokenStream, map_tokens, open_data_file

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSION_DTYPES = {1: "uint16", 2: "uint32"}
GLOB_CHARACTERS = "*?["


def is_shard(path: str) -> bool:
    """Whether the regular file `path` begins with a shard's magic number."""
    if not safe_files.is_regular(path):
        return False
    with safe_files.open_read(path) as handle:
        first = handle.read(4)
    return len(first) == 4 and int.from_bytes(first, "little", signed=True) == MAGIC


def shard_paths(pattern: str) -> list[str]:
    """The files a glob (or one file's path) names, in name order."""
    paths = sorted(glob.glob(os.path.expanduser(pattern))) if any(c in pattern for c in GLOB_CHARACTERS) \
        else [pattern]
    if not paths:
        raise DataError(f"{pattern!r} matches no file; give a glob of llm.c / modded-nanogpt shards, "
                        "e.g. 'fineweb10B/fineweb_train_*.bin'")
    return paths


def read_shard(path: str) -> np.ndarray:
    """One checked shard's tokens, memory-mapped."""
    with open_data_file(path) as handle:  # no link, FIFO or directory
        size = handle.seek(0, 2)
        handle.seek(0)
        header = np.frombuffer(handle.read(HEADER_BYTES), dtype="<i4")
    if len(header) < HEADER_INTS:
        raise DataError(f"{path!r} is {size} bytes, shorter than a shard's {HEADER_BYTES}-byte header")
    magic, version, count = (int(value) for value in header[:3])
    if magic != MAGIC:
        raise DataError(f"{path!r} has magic {magic}, not llm.c's {MAGIC}: it is not a token shard")
    if version not in VERSION_DTYPES:
        raise DataError(f"{path!r} has shard version {version}; known are 1 (uint16 tokens) and 2 (uint32)")
    dtype = np.dtype(VERSION_DTYPES[version])
    if count < 0 or HEADER_BYTES + count * dtype.itemsize != size:
        raise DataError(f"{path!r} says it holds {count} {dtype} tokens ({HEADER_BYTES + count * dtype.itemsize} "
                        f"bytes with the header) but it is {size} bytes; it is truncated or its header is wrong")
    return map_tokens(path, dtype, HEADER_BYTES, count)


def open_shards(pattern: str) -> TokenStream:
    """Every shard a glob names, checked, as one stream."""
    arrays = [read_shard(path) for path in shard_paths(pattern)]
    dtypes = {str(array.dtype) for array in arrays}
    if len(dtypes) > 1:
        raise DataError(f"the shards of {pattern!r} mix token types ({', '.join(sorted(dtypes))}); "
                        "one source holds one tokenizer's shards")
    return TokenStream([array for array in arrays if len(array)] or arrays[:1], pattern)
