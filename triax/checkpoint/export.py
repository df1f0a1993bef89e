"""Consolidation: a snapshot's model weights (any layout) as one safetensors file, streamed.

The header of a safetensors file lists every tensor's dtype, shape and byte range, and all of that
is known from the snapshot's shard metadata before any tensor is read. So the file is written
header first, then each tensor assembled from its verified chunks and written out in turn: at most
one full tensor is in memory at once, whatever the size of the model.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch
from tqdm import tqdm

from triax.checkpoint.errors import SnapshotError
from triax.checkpoint.reader import SnapshotReader
from triax.checkpoint.shard_format import tensor_bytes
from triax.checkpoint.snapshot import MODEL_KEY, OPTIMIZER_KEY
from triax.checkpoint.storage import create_new

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def _fits(stored: list[int], wanted: list[int]) -> bool:
    """Only the leading dimension may shrink (padding rows of a vocabulary); the rest must match."""
    return len(stored) == len(wanted) and stored[1:] == wanted[1:] and (not wanted or wanted[0] <= stored[0])


def _trim(tensor: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """The leading `shape` block of `tensor` (drops vocabulary padding rows)."""
    for dim, size in enumerate(shape):
        tensor = tensor.narrow(dim, 0, size)
    return tensor


def model_shapes(reader: SnapshotReader, shapes: dict[str, list[int]] | None = None) -> dict:
    """{name: (dtype, exported shape)} of the snapshot's model tensors; `shapes` overrides some
    (smaller along a dimension: the padding of a tensor-parallel vocabulary is dropped)."""
    result = {}
    for key in reader.tensor_names():
        if not key.startswith(MODEL_KEY):
            continue
        name = key[len(MODEL_KEY):]
        dtype, size = reader.tensor_info(key)
        wanted = list((shapes or {}).get(name, size))
        if not _fits(size, wanted):
            raise SnapshotError(f"snapshot {reader.snapshot}: {name} has shape {size}, which cannot be cut to {wanted}")
        result[name] = (dtype, wanted)
    return result


def export_safetensors(reader: SnapshotReader, output: str, shapes: dict[str, list[int]] | None = None,
                       metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """Write the model tensors of `reader`'s snapshot to `output` (safetensors), one tensor at a
    time; written under a temporary name and renamed, so no half-written file ever carries the
    final name. Returns (tensors, values) written."""
    plan = model_shapes(reader, shapes)
    header, offset = {}, 0
    for name, (dtype, shape) in plan.items():
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = f"{output}.tmp{os.getpid()}"
    try:
        with create_new(tmp) as handle:
            handle.write(struct.pack("<Q", len(encoded)))
            handle.write(encoded)
            # A bar on a terminal only (disable=None): a large model's export takes minutes.
            with tqdm(total=offset, unit="B", unit_scale=True, desc="export", leave=False, disable=None) as progress:
                for name, (_, shape) in plan.items():
                    tensor = _trim(reader.full_tensor(MODEL_KEY + name), shape)
                    data = tensor_bytes(tensor)
                    handle.write(data)
                    progress.update(len(data))
                    del tensor, data
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, output)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(plan), sum(math.prod(shape) for _, shape in plan.values())


def load_module_streaming(reader: SnapshotReader, module: torch.nn.Module) -> None:
    """Copy the snapshot's model tensors into a plain (unsharded) `module`, one tensor at a time;
    a stored tensor with more rows than the module's (vocabulary padding) is cut to its rows."""
    own = module.state_dict(keep_vars=True)
    missing = [name for name in own if MODEL_KEY + name not in reader.shards["tensors"]]
    if missing:
        raise SnapshotError(f"snapshot {reader.snapshot} lacks {len(missing)} tensor(s) of this model, e.g. "
                            f"{missing[0]!r}; was it written by a different model configuration?")
    with torch.no_grad():
        for name, target in own.items():
            _, size = reader.tensor_info(MODEL_KEY + name)
            wanted = list(target.shape)
            if not _fits(size, wanted):
                raise SnapshotError(f"snapshot {reader.snapshot}: {name} has shape {size}, the model needs {wanted}")
            target.copy_(_trim(reader.full_tensor(MODEL_KEY + name), wanted))


class TensorSource:
    """A snapshot's model tensors by plain parameter name, each assembled from its verified chunks
    only when asked for: a name -> tensor source for converters (e.g. the Hugging Face export)
    that never holds more than the tensors its caller keeps."""

    def __init__(self, reader: SnapshotReader, shapes: dict[str, list[int]] | None = None, prefix: str = MODEL_KEY,
                 suffix: str = ""):
        self.reader = reader
        self.shapes = shapes or {}  # names whose stored rows are cut (vocabulary padding)
        # prefix + name + suffix: a parameter ("model/<name>") or one of its optimizer tensors
        # ("optim/<name>/exp_avg"), which are laid out as the parameter and padded alike.
        self.prefix, self.suffix = prefix, suffix
        middles = [key[len(prefix):len(key) - len(suffix)] for key in reader.shards["tensors"]
                   if key.startswith(prefix) and key.endswith(suffix)]
        self._names = [name for name in middles if "/" not in name]

    def keys(self) -> list[str]:
        return list(self._names)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        tensor = self.reader.full_tensor(self.prefix + name + self.suffix)
        return _trim(tensor, self.shapes[name]) if name in self.shapes else tensor


def tensor_source(reader: SnapshotReader, shapes: dict[str, list[int]] | None = None) -> TensorSource:
    return TensorSource(reader, shapes)


def optimizer_source(reader: SnapshotReader, key: str, shapes: dict[str, list[int]] | None = None) -> TensorSource:
    """The snapshot's optimizer tensors `key` (exp_avg, exp_avg_sq, step) by parameter name."""
    return TensorSource(reader, shapes, OPTIMIZER_KEY, "/" + key)
