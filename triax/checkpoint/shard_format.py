"""The format of a snapshot's tensor shards, shared by the writer (triax/checkpoint/shards.py) and
the validating reader (triax/checkpoint/reader.py): where the files are, which dtypes they may
hold, and the raw little-endian bytes of one tensor.

    shards.json = {"tensors": {key: {"dtype": "float32", "size": [...], "chunks": [
                       {"offsets": [...], "sizes": [...], "file": "shards/rank_00001.bin",
                        "offset": 0, "bytes": 4096, "sha256": "..."}, ...]}},
                   "files": {"shards/rank_00001.bin": {"bytes": ..., "sha256": ...}}}
"""

from __future__ import annotations

import torch

SHARDS_METADATA = "shards.json"
DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def shard_file(rank: int) -> str:
    return f"shards/rank_{rank:05d}.bin"


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a CPU tensor, any dtype (bf16 included)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
