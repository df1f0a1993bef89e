"""The one way triax reads a file another tool wrote with torch.save (Accelerate's optimizer.bin,
random_states_<rank>.pkl, custom_checkpoint_<i>.pkl; nanoGPT's ckpt.pt; a Trainer's
optimizer.pt): torch's weights-only unpickler, which rebuilds tensors, numbers, strings, lists,
tuples and dicts and refuses any other global (a pickle calling os.system is refused before it
runs). `numpy_rng=True` also allows the four numpy names that np.random.get_state() pickles to
(an ndarray of uint32 and its dtype), which Accelerate's RNG files hold; nothing else is ever
allowed. The file is opened through safe_files (no link, no FIFO) and hashed as it is read, so a
caller holding a manifest can check it.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import pickletools
import re
from typing import Callable

import numpy as np
import torch

from triax import safe_files
from triax.checkpoint.errors import SnapshotCorruptError

# What np.random.get_state() becomes in a pickle: the array's reconstructor, the ndarray and
# dtype classes, and (numpy >= 1.25) the uint32 dtype's class. Accelerate's loader allows the
# same names for the same files.
_NUMPY_CORE = np._core if hasattr(np, "_core") else np.core
NUMPY_RNG_GLOBALS = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype]
if hasattr(np, "dtypes"):
    NUMPY_RNG_GLOBALS.append(np.dtypes.UInt32DType)


class PickledFileError(SnapshotCorruptError, ValueError):
    """A torch.save file that the weights-only loader refuses, or that is not a torch.save file."""


def read_pickled(path: str, what: str, numpy_rng: bool = False, expected_sha256: str | None = None):
    """The object in the torch.save file at `path` (a `what`, for messages), on the CPU."""
    data = read_whole(path, what)
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise PickledFileError(f"{path} does not match the sha256 its folder's manifest records; the file "
                               "changed after it was written: restore it or use an earlier checkpoint")
    return load_pickled_bytes(data, f"{path} ({what})", numpy_rng)


def read_whole(path: str, what: str) -> bytes:
    """A weights file's bytes (no size cap: a checkpoint is as large as its model), through
    safe_files: never a link, a FIFO or a directory."""
    try:
        with safe_files.open_read(path) as handle:
            return handle.read()
    except FileNotFoundError:
        raise PickledFileError(f"{path} is missing: the {what} it should hold cannot be read") from None


def load_pickled_bytes(data: bytes, where: str, numpy_rng: bool = False):
    return _weights_only(lambda: torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), where, numpy_rng)


def load_pickled_mapped(path: str, where: str):
    """The object in the torch.save file at `path` (checked by the caller: a regular file, no
    link leaving its folder), its tensors memory-mapped: only the slices a caller reads are paged
    in, so a rank holding part of a model reads only that part of the file."""
    if not _is_zip(path):
        # Not torch.save's archive (a plain or legacy pickle): never unpickled; what it would have
        # run is named from its opcodes.
        name = foreign_global(path)
        if name is not None:
            raise PickledFileError(f"{where} is a plain pickle that needs {name} to be unpickled, which triax never "
                                   "runs; re-save it with torch.save as tensors, numbers, strings, lists and dicts")
        raise PickledFileError(f"{where} is not a torch.save archive (a plain or legacy pickle, or damaged); re-save "
                               "it with torch.save")
    return _weights_only(lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True), where)


def _is_zip(path: str) -> bool:
    with safe_files.open_read(path) as handle:
        return handle.read(4) == b"PK\x03\x04"


# What torch's own archives name: its tensor rebuilders and storages, and OrderedDict.
_TORCH_GLOBAL = re.compile(r"^(torch(\.[\w.]+)?|collections\.OrderedDict|_codecs\.encode)$")
_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING", "STRING")


def foreign_global(path: str, max_bytes: int = 64 * 2**20) -> str | None:
    """The first global (module.name) a pickle file would import that torch.save's own files do not,
    read from its opcodes without unpickling (the first `max_bytes` only)."""
    with safe_files.open_read(path) as handle:
        data = handle.read(max_bytes)
    offset = 0
    try:
        for _ in range(8):  # torch's legacy format is a few pickles in a row (magic, protocol, info, data)
            name, offset = _first_foreign(data, offset)
            if name is not None or offset >= len(data):
                return name
    except (ValueError, EOFError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return None


def _first_foreign(data: bytes, offset: int) -> tuple[str | None, int]:
    """(the first foreign global of the pickle at `offset`, or None; where the next pickle starts)."""
    strings: list[str] = []
    end = len(data)
    stream = io.BytesIO(data)
    stream.seek(offset)
    for opcode, argument, position in pickletools.genops(stream):
        if opcode.name in _STRINGS:
            strings = (strings + [str(argument)])[-2:]
        name = None
        if opcode.name in ("GLOBAL", "INST"):
            name = str(argument).replace(" ", ".")
        elif opcode.name == "STACK_GLOBAL" and len(strings) == 2:
            name = ".".join(strings)
        if name is not None and not _TORCH_GLOBAL.match(name):
            return name[:120], end
        end = position + 1  # genops gives positions in the stream
    return None, end
    return None


def _weights_only(load: Callable[[], object], where: str, numpy_rng: bool = False):
    allowed = NUMPY_RNG_GLOBALS if numpy_rng else []
    try:
        with torch.serialization.safe_globals(allowed):
            return load()
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        if found is None:  # not a pickle torch.save wrote (garbage, truncated)
            raise PickledFileError(f"{where} is not a readable torch.save file ({str(error).splitlines()[0][:120]}); "
                                   "it is damaged or of another kind") from None
        name = found.group(1)
        raise PickledFileError(f"{where} needs {name} to be unpickled, which triax never runs (it reads such "
                               "files with torch's weights-only loader only); re-save it as tensors, numbers, "
                               "strings, lists and dicts") from None
    except (RuntimeError, ValueError, EOFError, KeyError, TypeError, AttributeError, IndexError,
            OverflowError, MemoryError) as error:
        first = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise PickledFileError(f"{where} is not a readable torch.save file ({first}); it is damaged or of "
                               "another kind") from None


def pickled_bytes(value: object) -> bytes:
    """torch.save of `value`, as bytes (to be hashed and written atomically)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
