"""Snapshots: everything needed to continue a run, in a layout-independent, pickle-free format.

A snapshot is a directory:

    step_00000100/
        model.safetensors      full (consolidated) model weights, by parameter name
        optimizer.safetensors  optimizer state tensors, keyed "<param name>/<state key>"
        state.json             step, data position, scheduler, scaler, optimizer hyper-parameters,
                               config, triax version, world size
        rng/rank_00000.json    each rank's random-number generator states

Model and optimizer state go through torch.distributed.checkpoint.state_dict, which gives the same
full, name-keyed state for a plain module, DDP, FSDP2 or tensor-parallel DTensors, so a snapshot
taken in one layout loads into any other. Loading reads only safetensors and JSON: nothing is
unpickled.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from triax.errors import TriaxError

SNAPSHOT_PREFIX = "step_"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def snapshot_name(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step:08d}"


def list_snapshots(snapshot_root: str) -> list[str]:
    """Complete snapshot directories under `snapshot_root`, oldest first."""
    if not os.path.isdir(snapshot_root):
        return []
    names = sorted(name for name in os.listdir(snapshot_root)
                   if name.startswith(SNAPSHOT_PREFIX) and not name.endswith(".tmp")
                   and os.path.exists(os.path.join(snapshot_root, name, "state.json")))
    return [os.path.join(snapshot_root, name) for name in names]


def latest_snapshot(snapshot_root: str) -> str | None:
    snapshots = list_snapshots(snapshot_root)
    return snapshots[-1] if snapshots else None


# ---- random-number generator states (per rank) -------------------------------------------------

def capture_rng_state() -> dict:
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state()),
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(_python_rng_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [_bytes_tensor(s) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


def _bytes_tensor(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8).clone()


def _python_rng_tuple(value):
    version, internal, gauss = value
    return version, tuple(internal), gauss


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# ---- optimizer state <-> flat tensors + JSON ---------------------------------------------------

def _flatten_optimizer(state_dict: dict) -> tuple[dict, dict]:
    tensors, scalars = {}, {}
    for name, entries in state_dict["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.contiguous()
            else:
                scalars[f"{name}/{key}"] = value
    return tensors, {"scalars": scalars, "param_groups": state_dict["param_groups"]}


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state: dict[str, dict] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, key = flat.rsplit("/", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


# ---- save / load -------------------------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """(model state, optimizer state), full and keyed by parameter name, on rank 0 at least."""
    model_state = get_model_state_dict(model, options=_FULL)
    optim_state = get_optimizer_state_dict(model, optimizer, options=_FULL) if optimizer else None
    return model_state, optim_state


def apply_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     model_state: dict, optim_state: dict | None) -> None:
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))


def save_snapshot(snapshot_root: str, step: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None, state: dict, gather=gather_full_state) -> str:
    """Write a snapshot of `model`, `optimizer` and the JSON-able `state`. Collective: every rank
    of the job calls it. The directory appears under its final name only when complete.
    `gather(model, optimizer)` collects the full state (a pipeline stage holds only part of it:
    see triax.parallel.pipeline_checkpoint)."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    final = os.path.join(snapshot_root, snapshot_name(step))
    staging = final + ".tmp"
    # Gathering full state is collective for sharded models: every rank takes part.
    model_state, optim_state = gather(model, optimizer)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(os.path.join(staging, "rng"))
    _barrier()
    with open(os.path.join(staging, "rng", f"rank_{rank:05d}.json"), "w") as handle:
        json.dump(capture_rng_state(), handle)
    if rank == 0:
        # Tied weights share storage, which safetensors refuses; each name gets its own copy.
        save_file({name: tensor.detach().clone().contiguous() for name, tensor in model_state.items()},
                  os.path.join(staging, "model.safetensors"))
        meta = {}
        if optim_state is not None:
            tensors, meta = _flatten_optimizer(optim_state)
            save_file(tensors, os.path.join(staging, "optimizer.safetensors"))
        from triax import __version__

        record = dict(state, step=step, world_size=world, triax_version=__version__, optimizer=meta)
        with open(os.path.join(staging, "state.json"), "w") as handle:
            json.dump(record, handle, indent=1)
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    _barrier()
    return final


def read_state(snapshot: str) -> dict:
    with open(os.path.join(snapshot, "state.json")) as handle:
        return json.load(handle)


def load_snapshot(snapshot: str, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True,
                  apply=apply_full_state) -> dict:
    """Load a snapshot into `model` (and `optimizer`), whatever layout either was saved or is
    now in. Returns the JSON state. Tensors are read to CPU first, then placed by
    `apply(model, optimizer, model_state, optimizer_state)`."""
    if not os.path.exists(os.path.join(snapshot, "state.json")):
        raise TriaxError(f"{snapshot!r} is not a triax snapshot (no state.json)")
    state = read_state(snapshot)
    model_state = load_file(os.path.join(snapshot, "model.safetensors"))
    optim_state = None
    if optimizer is not None and state.get("optimizer"):
        tensors = load_file(os.path.join(snapshot, "optimizer.safetensors"))
        optim_state = _unflatten_optimizer(tensors, state["optimizer"])
    apply(model, optimizer, model_state, optim_state)
    if restore_rng:
        rng_file = os.path.join(snapshot, "rng", f"rank_{_rank():05d}.json")
        if os.path.exists(rng_file):  # a rank that did not exist when saving keeps its own seed
            with open(rng_file) as handle:
                restore_rng_state(json.load(handle))
    return state
