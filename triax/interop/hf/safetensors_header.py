"""The header of a safetensors file, read and checked before the safetensors library opens it.

A safetensors file is 8 bytes (the header's length, little-endian), a JSON header naming each
tensor's dtype, shape and byte range, then the tensors' bytes. The library itself reports a bad
file as a SafetensorError with a Rust message, or maps a file too short for what its header
claims; a file that is not safetensors at all (a pickle saved under the name) reads as a header
length of petabytes. Checked here, from the header alone and before any tensor is read:
- the header length is at most safetensors' own bound (100 MB) and fits the file;
- the header is UTF-8 JSON (no NaN), an object of objects with a known dtype, a shape of
  non-negative integers and a [begin, end) byte range each;
- every range holds exactly its shape's bytes (so a shape whose product overflows a 64-bit size is
  refused here), and the ranges tile the data that follows the header without gap or overlap, to
  the file's last byte (what the library requires too).
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

from triax import safe_files

# safetensors' own bound on the header (its MAX_HEADER_SIZE): a longer one is not a real file.
MAX_HEADER_BYTES = 100_000_000
# Bytes per value of each dtype safetensors writes (F8 kinds: one byte; the 4-bit and 6-bit
# kinds of recent versions are not read by triax, so a file holding them is refused as unknown).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
# The dtypes a floating parameter may be read from (converted to the model's dtype): no 8-bit
# float (those checkpoints carry separate scales triax does not apply), no integer or bool.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# The safetensors name of a torch dtype, for checkpoints read from other files (nanoGPT's ckpt.pt)
# checked by the same rules.
TORCH_DTYPE_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                     "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class HeaderError(ValueError):
    """The file is not a well-formed safetensors file (the message says why, without the path)."""


class TensorEntry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]


def read_header(path: str) -> dict[str, TensorEntry]:
    """{tensor name: (dtype, shape)} of the safetensors file at `path` (a regular file, not a link:
    resolve and check links before); HeaderError or safe_files.UnsafeFileError when it is not sound."""
    with safe_files.open_read(path) as handle:
        file_bytes = os.fstat(handle.fileno()).st_size
        if file_bytes < 8:
            raise HeaderError(f"it is {file_bytes} bytes, shorter than a safetensors header")
        header_bytes = int.from_bytes(handle.read(8), "little")
        if header_bytes > min(MAX_HEADER_BYTES, file_bytes - 8):
            raise HeaderError(f"its first 8 bytes give a header of {header_bytes} bytes, more than the file's "
                              f"{file_bytes - 8} after them (or safetensors' bound of {MAX_HEADER_BYTES}); "
                              "it is truncated or not a safetensors file")
        raw = handle.read(header_bytes)
    if len(raw) != header_bytes:
        raise HeaderError("it was truncated while being read")
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise HeaderError(f"its header is not UTF-8 JSON ({type(error).__name__}: {str(error)[:100]})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"its header is a JSON {type(header).__name__}, not an object")
    return _entries(header, file_bytes - 8 - header_bytes)


def _entries(header: dict, data_bytes: int) -> dict[str, TensorEntry]:
    entries, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":  # free text: string to string, as the library requires
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise HeaderError("its header's __metadata__ is not a mapping of strings to strings")
            continue
        if not isinstance(entry, dict):
            raise HeaderError(f"its header's {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise HeaderError(f"tensor {name!r} has dtype {dtype!r}; safetensors' dtypes are {', '.join(DTYPE_BYTES)}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(_count(size) for size in shape):
            raise HeaderError(f"tensor {name!r} has shape {str(shape)[:100]}; a shape is at most 8 non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise HeaderError(f"tensor {name!r} has data_offsets {str(offsets)[:100]}, not [begin, end] with begin <= end")
        size = math.prod(shape) * DTYPE_BYTES[dtype]  # exact: Python integers do not overflow
        if offsets[1] - offsets[0] != size:
            raise HeaderError(f"tensor {name!r} is {dtype} of shape {shape} ({size} bytes) but its data_offsets "
                              f"{offsets} hold {offsets[1] - offsets[0]}")
        entries[name] = TensorEntry(dtype, tuple(shape))
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(ranges):
        if begin != end:
            raise HeaderError(f"tensor {name!r} starts at byte {begin} of the data, where {end} was expected; "
                              "the tensors' byte ranges overlap or leave a gap")
        end = stop
    if end != data_bytes:
        raise HeaderError(f"its tensors hold {end} bytes but the file has {data_bytes} after the header; "
                          "it is truncated or damaged")
    return entries


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")
