"""Random-number generator states (Python, NumPy, torch CPU, every CUDA device) as JSON.

Each rank has its own streams (dropout masks differ across ranks), so each rank saves its own.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def capture_rng_state() -> dict:
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state()),
        "torch": _encode(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [_decode(s) for s in state["cuda"]]
        # A machine with fewer GPUs than the one that saved restores the ones it has.
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


def check_rng_state(state: object, snapshot: str) -> None:
    """Raise SnapshotCorruptError unless `state` has the shape capture_rng_state gives, so that
    restoring it cannot fail half-way (it runs after every rank agreed the snapshot is good)."""
    from triax.checkpoint.errors import SnapshotCorruptError

    def ints(value: object, count: int):
        return isinstance(value, list) and len(value) == count and all(type(v) is int for v in value)

    try:
        python, numpy_state, torch_state = state["python"], state["numpy"], state["torch"]
        good = (isinstance(python, list) and len(python) == 3 and type(python[0]) is int
                and ints(python[1], 625) and (python[2] is None or isinstance(python[2], float))
                and isinstance(numpy_state, list) and len(numpy_state) == 5 and numpy_state[0] == "MT19937"
                and ints(numpy_state[1], 624) and all(0 <= v < 2**32 for v in numpy_state[1])
                and type(numpy_state[2]) is int and type(numpy_state[3]) is int
                and isinstance(numpy_state[4], (int, float))
                and all(0 <= v < 2**32 for v in python[1])
                and isinstance(torch_state, str)
                and len(base64.b64decode(torch_state, validate=True)) == torch.get_rng_state().numel()
                and (isinstance(state.get("cuda", []), list) and all(isinstance(s, str) for s in state.get("cuda", []))))
    except (KeyError, TypeError, ValueError):
        good = False
    if not good:
        raise SnapshotCorruptError(f"snapshot {snapshot}: a random-number generator state is malformed")


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8).clone()


def _jsonable(value: object):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (NumPy takes 32 bits)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
