"""save_state / load_state for the Accelerator, through triax's snapshot module.

The first prepared model and its optimizer go into the snapshot itself (safetensors, JSON, RNG
states per rank: triax.checkpoint). Everything else a run needs to continue exactly — schedulers,
the loss scaler, each dataloader's position, objects given to register_for_checkpointing, further
models — rides along in the snapshot's JSON state, or, for further models, in sibling snapshots
`<root>/model_<i>/step_<n>` written *before* the main one, whose appearance marks completion.
Nothing is pickled.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import torch

from triax.checkpoint import latest_snapshot, load_snapshot, save_snapshot
from triax.errors import TriaxError

# ---- JSON for state dicts (tensors, tuples, non-string keys) without pickle ---------------------


def to_json(value):
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous()
        raw = array.reshape(-1).view(torch.uint8)  # bytes of any dtype, bf16 included
        return {"__tensor__": base64.b64encode(raw.numpy().tobytes()).decode(),
                "dtype": str(array.dtype).removeprefix("torch."), "shape": list(array.shape)}
    if isinstance(value, np.ndarray):
        return to_json(torch.from_numpy(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: to_json(item) for key, item in value.items()}
        return {"__items__": [[to_json(key), to_json(item)] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(item) for item in value]}
    if isinstance(value, list):
        return [to_json(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TriaxError(f"save_state cannot store a {type(value).__name__} ({value!r:.60}) from a "
                     "state_dict; keep state dicts to tensors, numbers, strings, lists and dicts")


def from_json(value):
    if isinstance(value, list):
        return [from_json(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        dtype = getattr(torch, value["dtype"])
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        if not raw:
            return torch.empty(value["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(value["shape"]).clone()
    if "__tuple__" in value:
        return tuple(from_json(item) for item in value["__tuple__"])
    if "__items__" in value:
        return {from_json(key): from_json(item) for key, item in value["__items__"]}
    return {key: from_json(item) for key, item in value.items()}


# ---- pairing optimizers with the models whose parameters they hold ------------------------------


def pair_optimizers(models: list, optimizers: list) -> list:
    """For each model, its one prepared optimizer (or None)."""
    pairs = [None] * len(models)
    for optimizer in optimizers:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [i for i, model in enumerate(models) if params & {id(p) for p in model.parameters()}]
        if len(owners) != 1 or pairs[owners[0]] is not None:
            raise TriaxError("save_state supports one optimizer per prepared model, each holding that "
                             f"model's parameters; found an optimizer matching models {owners}")
        pairs[owners[0]] = optimizer
    return pairs


def resolve_snapshot(path: str) -> str:
    """A snapshot directory, or the latest snapshot under a root written by save_state."""
    if os.path.exists(os.path.join(path, "state.json")):
        return path
    snapshot = latest_snapshot(path)
    if snapshot is None:
        raise TriaxError(f"load_state found no snapshot in {path!r}; pass the directory save_state "
                         "wrote to (or one of its step_* folders)")
    return snapshot


def _in_snapshot(optimizer):
    """The raw optimizer if its state goes into the snapshot's safetensors, else None.
    An optimizer without per-parameter state (plain SGD) cannot go through
    torch.distributed.checkpoint's loader, which needs a state tensor to find the device; its
    hyper-parameters travel in the JSON state instead."""
    if optimizer is None or not any(optimizer.optimizer.state.values()):
        return None
    return optimizer.optimizer


def save_state(accelerator, root: str, step: int) -> str:
    models = accelerator._models
    if not models:
        raise TriaxError("save_state needs at least one prepared model; call accelerator.prepare(model, ...)")
    optimizers = pair_optimizers(models, accelerator._optimizers)
    snapshot_name = None
    for index in range(1, len(models)):
        extra = save_snapshot(os.path.join(root, f"model_{index}"), step, models[index],
                              _in_snapshot(optimizers[index]), {})
        snapshot_name = os.path.basename(extra)
    state = {"accelerator": {
        "num_models": len(models),
        "schedulers": [to_json(scheduler.state_dict()) for scheduler in accelerator._schedulers],
        "scaler": to_json(accelerator.scaler.state_dict()),
        "dataloaders": [loader.state_dict() for loader in accelerator._dataloaders],
        "custom": [to_json(obj.state_dict()) for obj in accelerator._custom_objects],
        "optimizer_steps": [optimizer.num_steps for optimizer in accelerator._optimizers],
        "micro_step": accelerator.gradient_state.micro_step,
        "stateless_optimizers": [to_json(optimizer.optimizer.state_dict())
                                 if optimizer is not None and _in_snapshot(optimizer) is None else None
                                 for optimizer in optimizers],
    }}
    path = save_snapshot(root, step, models[0], _in_snapshot(optimizers[0]), state)
    assert snapshot_name in (None, os.path.basename(path))
    return path


def load_state(accelerator, path: str) -> str:
    snapshot = resolve_snapshot(path)
    models = accelerator._models
    optimizers = pair_optimizers(models, accelerator._optimizers)
    root = os.path.dirname(snapshot)
    from triax.checkpoint import read_state

    state = read_state(snapshot).get("accelerator")
    if state is None:
        raise TriaxError(f"{snapshot!r} is a triax snapshot but not one written by Accelerator.save_state")
    if state["num_models"] != len(models):
        raise TriaxError(f"{snapshot!r} holds {state['num_models']} models but this run prepared "
                         f"{len(models)}; prepare the same objects before load_state")
    stateless = state.get("stateless_optimizers", [None] * len(models))

    def raw(index):
        optimizer = optimizers[index]
        return optimizer.optimizer if optimizer is not None and stateless[index] is None else None

    for index in range(1, len(models)):
        load_snapshot(os.path.join(root, f"model_{index}", os.path.basename(snapshot)), models[index],
                      raw(index), restore_rng=False)
    # Last, so the random-number generators are left exactly as they were at save time.
    load_snapshot(snapshot, models[0], raw(0), restore_rng=True)
    for optimizer, saved in zip(optimizers, stateless):
        if optimizer is not None and saved is not None:
            optimizer.optimizer.load_state_dict(from_json(saved))
    checks = [("models", state["num_models"], len(models)),
              ("schedulers", len(state["schedulers"]), len(accelerator._schedulers)),
              ("dataloaders", len(state["dataloaders"]), len(accelerator._dataloaders)),
              ("registered objects", len(state["custom"]), len(accelerator._custom_objects))]
    for what, saved, now in checks:
        if saved != now:
            raise TriaxError(f"{snapshot!r} holds {saved} {what} but this run prepared {now}; "
                             "prepare (and register) the same objects before load_state")
    for scheduler, saved in zip(accelerator._schedulers, state["schedulers"]):
        scheduler.load_state_dict(from_json(saved))
    accelerator.scaler.load_state_dict(from_json(state["scaler"]))
    for loader, saved in zip(accelerator._dataloaders, state["dataloaders"]):
        loader.load_state_dict(saved)
    for obj, saved in zip(accelerator._custom_objects, state["custom"]):
        obj.load_state_dict(from_json(saved))
    for optimizer, steps in zip(accelerator._optimizers, state["optimizer_steps"]):
        optimizer.num_steps = steps
    accelerator.gradient_state.micro_step = state["micro_step"]
    return snapshot
