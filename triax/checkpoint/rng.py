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


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8).clone()


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
