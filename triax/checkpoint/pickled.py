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
import re

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
    return _weights_only(lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True), where)


def _weights_only(load, where: str, numpy_rng: bool = False):
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


def pickled_bytes(value) -> bytes:
    """torch.save of `value`, as bytes (to be hashed and written atomically)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
