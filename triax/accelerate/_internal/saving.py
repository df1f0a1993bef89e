"""save_state / load_state for the Accelerator, through triax's snapshot module.

The first prepared model and its optimizer go into the snapshot itself (safetensors, JSON, RNG
states per rank: triax.checkpoint). Everything else a run needs to continue exactly — schedulers,
the loss scaler, a stateful dataloader's position, objects given to register_for_checkpointing, further
models — rides along in the snapshot's JSON state, or, for further models, in sibling snapshots
`<root>/model_<i>/step_<n>` written *before* the main one, whose appearance marks completion.
Optimizers need not match models one to one (snapshot_units): models that one optimizer steps
together share a snapshot, and so do parameters an optimizer steps that no prepared model holds.
Nothing is pickled, and nothing read is trusted: the Accelerator's part of state.json is checked
against a schema (types, sizes, tensor dtypes from a fixed list, byte counts that match shapes)
before anything is applied, and every process agrees on the outcome before any collective.

Storage seam: `_write_snapshot` and `_read_snapshot` are the only calls into the snapshot format;
switching to another format (e.g. sharded snapshots) means changing those two and nothing above.
"""

from __future__ import annotations

import base64
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from triax.accelerate._internal.errors import (
    AcceleratorRuntimeError,
    AcceleratorTypeError,
    AcceleratorValueError,
    StateCorruptError,
)
from triax.checkpoint import latest_snapshot, load_snapshot, read_state, save_snapshot
from triax.checkpoint.numbers import bad_number, is_number
from triax.errors import TriaxError
from triax.runtime.failure_agreement import raise_together

if TYPE_CHECKING:
    from triax.accelerate._internal.checkpointed import Checkpointed
    from triax.accelerate._internal.wrappers import PreparedOptimizer

# Tensors a state dict may hold (optimizer steps, scaler scale, RNG-like buffers); anything else in
# a file is corruption, never a name to look up on the torch module.
TENSOR_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128")}
MAX_DIMS = 16

# ---- JSON for state dicts (tensors, tuples, non-string keys) without pickle ---------------------


def to_json(value: Any):
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
    if isinstance(value, float) and not math.isfinite(value):
        # Spelled out: snapshot JSON is strict (no NaN or Infinity literal), but a state may hold
        # inf on purpose (ReduceLROnPlateau's best before its first epoch).
        return {"__float__": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise AcceleratorTypeError(f"save_state cannot store a {type(value).__name__} ({value!r:.60}) from a "
                     "state_dict; keep state dicts to tensors, numbers, strings, lists and dicts")


def from_json(value: Any, where: str = "state"):
    """The inverse of to_json, for data read from a file: raises SnapshotCorruptError on anything
    to_json could not have written."""
    try:
        return _from_json(value, where)
    except RecursionError:
        raise StateCorruptError(f"{where} is nested too deeply to be a saved state") from None


def _from_json(value: Any, where: str):
    if isinstance(value, list):
        return [_from_json(item, where) for item in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return _tensor_from_json(value, where)
    if "__float__" in value:
        _expect(value.get("__float__") in ("inf", "-inf", "nan"), where, "a float that is not inf, -inf or nan")
        return float(value["__float__"])
    if "__tuple__" in value:
        _expect(isinstance(value["__tuple__"], list), where, "a tuple that is not a list")
        return tuple(_from_json(item, where) for item in value["__tuple__"])
    if "__items__" in value:
        items = value["__items__"]
        _expect(isinstance(items, list) and all(isinstance(i, list) and len(i) == 2 for i in items),
                where, "a mapping whose items are not [key, value] pairs")
        keys = [_from_json(key, where) for key, _ in items]
        _expect(all(isinstance(key, (int, float, str, bool, type(None), tuple)) for key in keys),
                where, "a mapping key that cannot be a key")
        return {key: _from_json(item, where) for key, (_, item) in zip(keys, items)}
    return {key: _from_json(item, where) for key, item in value.items()}


def _tensor_from_json(value: dict, where: str) -> torch.Tensor:
    dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("__tensor__")
    _expect(dtype in TENSOR_DTYPES, where, f"a tensor of dtype {dtype!r:.40}")
    _expect(isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape),
            where, f"a tensor shape {shape!r:.60}")
    _expect(isinstance(data, str), where, "tensor data that is not a string")
    dtype = TENSOR_DTYPES[dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for size in shape:
        count *= size
    # The bytes must be there for every element: a shape can never ask for more memory than the
    # file itself holds.
    _expect(len(data) * 3 // 4 + 3 >= count * itemsize, where, f"a tensor of shape {shape} with too little data")
    try:
        raw = bytearray(base64.b64decode(data, validate=True))
    except ValueError:
        raise StateCorruptError(f"{where} holds tensor data that is not base64") from None
    _expect(len(raw) == count * itemsize, where, f"a tensor of shape {shape} and {len(raw)} bytes")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _expect(condition: bool, where: str, what: str) -> None:
    if not condition:
        raise StateCorruptError(f"{where} is corrupt: it holds {what}")


def _is_int(value: Any, low: int = 0) -> bool:
    # Counters, seeds and positions: 63 bits at most (torch's seeds and indices are int64).
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**62


def validate_state(state: Any, snapshot: str) -> dict:
    """The Accelerator's part of state.json, checked for shape and types before anything uses it."""
    where = f"snapshot {snapshot}: state.json"
    _expect(isinstance(state, dict), where, "no 'accelerator' section of the right kind")
    lists = ("schedulers", "dataloaders", "custom", "optimizer_steps", "stateless_optimizers", "saved_models",
             "units")
    for key in lists:
        _expect(isinstance(state.get(key), list), where, f"no list {key!r}")
    _expect(_is_int(state.get("num_models")) and _is_int(state.get("micro_step")), where,
            "num_models or micro_step that are not non-negative integers")
    _expect(all(_is_int(i) for i in state["saved_models"]) and state["num_models"] == len(state["saved_models"]),
            where, "a saved_models list that does not match num_models")
    _expect(all(_is_int(n) for n in state["optimizer_steps"]), where, "optimizer step counts that are not integers")
    # A dataloader's entry is its StatefulDataLoader state (use_stateful_dataloader), else null.
    _expect(all(loader is None or isinstance(loader, dict) for loader in state["dataloaders"]), where,
            "a dataloader state that is neither null nor an object")
    _expect(isinstance(state.get("scaler"), dict), where, "no loss-scaler state")
    return state


def _check_scheduler(saved: Any, current: Any, snapshot: str, where: str | None = None) -> None:
    """A saved scheduler state has this scheduler's numeric fields as numbers (a last_epoch of
    "abc" would only fail later, inside the user's loop). `where`: the file it came from, when not
    the snapshot's state.json."""
    where = where or f"snapshot {snapshot}: state.json"
    _expect(isinstance(saved, dict), where, "a scheduler state that is not an object")
    for key, value in current.items():
        if is_number(value) and key in saved and not is_number(saved[key]):
            _expect(False, where, f"scheduler {key}={str(saved[key])[:40]!r} where a number belongs")
        if isinstance(value, list) and all(is_number(v) for v in value) and key in saved:
            _expect(isinstance(saved[key], list) and len(saved[key]) == len(value)
                    and all(is_number(v) for v in saved[key]), where,
                    f"scheduler {key} that is not a list of {len(value)} numbers")


# ---- which snapshot holds which models and optimizers ---------------------------------------------


class Holder(torch.nn.Module):
    """What a snapshot saves when one prepared model is not the whole story: the prepared models
    that one optimizer steps together (children `model_<index>`), and the parameters an optimizer
    steps that no prepared model holds (`parameters.<n>`, in the optimizers' order)."""

    def __init__(self, models: dict, loose: list):
        super().__init__()
        for index, model in models.items():
            self.add_module(f"model_{index}", model)
        self.parameters_of_no_model = torch.nn.Module()
        for number, parameter in enumerate(loose):
            # Kept as the very object the optimizer holds: optimizer state is matched by identity.
            self.parameters_of_no_model._parameters[str(number)] = parameter


def snapshot_units(models: list, optimizers: list, saved: list[int]) -> list[dict]:
    """What each snapshot holds: {"models": model indices, "optimizers": optimizer indices,
    "module": what is saved}, the first one being the main snapshot's. Saved models an optimizer
    steps together share a unit (transitively); an optimizer's parameters that no prepared model
    holds go with it. A unit of one model and no such parameters saves the model itself (so its
    snapshot holds the model's own parameter names). An optimizer over models a save hook took
    over only is left out with them."""
    owner = {}
    for index, model in enumerate(models):
        for parameter in model.parameters():
            owner.setdefault(id(parameter), index)
    root = {index: index for index in saved}  # union-find over the saved models

    def find(index: int) -> int:
        while root[index] != index:
            index = root[index]
        return index

    reach = []  # per optimizer: (saved models it steps, its parameters no model holds), or None
    for number, optimizer in enumerate(optimizers):
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        touched = sorted({owner[id(p)] for p in parameters if id(p) in owner})
        loose = [p for p in parameters if id(p) not in owner]
        hooked = [index for index in touched if index not in root]
        if hooked and (loose or len(hooked) < len(touched)):
            raise AcceleratorValueError(f"save_state: optimizer {number} steps parameters of models {hooked}, which "
                                        "a save hook took over, and of others; let the hook take over all of that "
                                        "optimizer's models or none")
        if hooked:
            reach.append(None)
            continue
        for index in touched[1:]:
            root[find(index)] = find(touched[0])
        reach.append((touched, loose))
    units = {}
    for index in saved:
        units.setdefault(find(index), {"models": [], "optimizers": [], "loose": []})["models"].append(index)
    stray = []  # optimizers over parameters of no prepared model only
    for number, entry in enumerate(reach):
        if entry is None:
            continue
        touched, loose = entry
        unit = units[find(touched[0])] if touched else {"models": [], "optimizers": [], "loose": []}
        if not touched:
            stray.append(unit)
        unit["optimizers"].append(number)
        unit["loose"].extend(loose)
    ordered = sorted(units.values(), key=lambda unit: unit["models"][0]) + stray
    for unit in ordered:
        if len(unit["models"]) == 1 and not unit["loose"]:
            unit["module"] = models[unit["models"][0]]
        else:
            unit["module"] = Holder({index: models[index] for index in unit["models"]}, unit.pop("loose"))
        unit.pop("loose", None)
    return ordered or [{"models": [], "optimizers": [], "module": _no_model()}]


def _unit_signature(units: list[dict]) -> list:
    return [[unit["models"], unit["optimizers"]] for unit in units]


def resolve_snapshot(path: str) -> str:
    """A snapshot directory, or the latest snapshot under a root written by save_state."""
    if os.path.exists(os.path.join(path, "state.json")):
        return path
    snapshot = latest_snapshot(path)
    if snapshot is None:
        raise AcceleratorValueError(f"load_state found no snapshot in {path!r}; pass the directory save_state "
                         "wrote to (or one of its step_* folders)")
    return snapshot


def _in_snapshot(optimizer: PreparedOptimizer) -> bool:
    """Whether an optimizer's state goes into the snapshot's tensors. One without per-parameter
    state (plain SGD) cannot go through torch.distributed.checkpoint's loader, which needs a state
    tensor to find the device; its hyper-parameters travel in the JSON state instead."""
    return any(optimizer.optimizer.state.values())


def _snapshot_optimizer(held: Checkpointed, unit: dict, in_snapshot: list[bool]):
    """The raw optimizer(s) of a unit whose state is in its snapshot: None, one, or a tuple."""
    raw = tuple(held.optimizers[number].optimizer for number in unit["optimizers"] if in_snapshot[number])
    return None if not raw else raw[0] if len(raw) == 1 else raw


def _no_model() -> torch.nn.Module:
    """What the snapshot holds when no model is saved (none prepared, or all taken over by hooks):
    torch.distributed.checkpoint refuses a model with an empty state dict, so one empty buffer."""
    placeholder = torch.nn.Module()
    placeholder.register_buffer("no_model", torch.zeros(0))
    return placeholder


# ---- the storage seam: the only two calls into the snapshot format -------------------------------


def _write_snapshot(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | tuple | None,
                    state: dict, full: bool = False) -> str:
    return save_snapshot(root, step, model, optimizer, state, full_state_dict=full)


def _read_snapshot(snapshot: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | tuple | None,
                   restore_rng: bool) -> None:
    load_snapshot(snapshot, model, optimizer, restore_rng=restore_rng)


# ---- save and load --------------------------------------------------------------------------------


def save_state(held: Checkpointed, root: str, step: int, saved: list[int]) -> str:
    """Write the models at indices `saved` of held.models (those no save hook took over)
    with their optimizers, and everything else as JSON. Collective."""
    units = snapshot_units(held.models, held.optimizers, saved)
    in_snapshot = [_in_snapshot(optimizer) for optimizer in held.optimizers]
    full = held.saves_full_state_dict
    snapshot_name = None
    for index in range(1, len(units)):
        extra = _write_snapshot(os.path.join(root, f"model_{index}"), step, units[index]["module"],
                                _snapshot_optimizer(held, units[index], in_snapshot), {}, full)
        snapshot_name = os.path.basename(extra)
    stepped = {number for unit in units for number in unit["optimizers"]}
    state = {"accelerator": {
        "num_models": len(saved),
        "saved_models": list(saved),
        "units": _unit_signature(units),
        "schedulers": [to_json(scheduler.state_dict()) for scheduler in held.schedulers],
        "scaler": to_json(held.grad_scaler.state_dict()),
        "dataloaders": [_dataloader_state(loader) for loader in held.dataloaders],
        "custom": [to_json(obj.state_dict()) for obj in held.custom_objects],
        "optimizer_steps": [optimizer.num_steps for optimizer in held.optimizers],
        "micro_step": held.gradient_state.micro_step,
        "stateless_optimizers": [to_json(optimizer.optimizer.state_dict())
                                 if number in stepped and not in_snapshot[number] else None
                                 for number, optimizer in enumerate(held.optimizers)],
    }}
    path = _write_snapshot(root, step, units[0]["module"], _snapshot_optimizer(held, units[0], in_snapshot),
                           state, full)
    assert snapshot_name in (None, os.path.basename(path))
    return path


def _dataloader_state(loader: torch.utils.data.DataLoader):
    """What save_state keeps of a prepared dataloader, as Accelerate: the StatefulDataLoader state
    of one made with use_stateful_dataloader=True (process 0's: every process is at the same
    step), else nothing (load_state restores the random states; scripts skip seen batches)."""
    return to_json(loader.state_dict()) if getattr(loader, "use_stateful_dataloader", False) else None


# The counters of a StatefulDataLoader state that its next pass fast-forwards through.
POSITION_COUNTERS = ("_sampler_iter_yielded", "_num_yielded", "_snapshot_step", "_steps_since_snapshot")


def _check_dataloader_position(saved: Any, loader: torch.utils.data.DataLoader, snapshot: str) -> None:
    """A saved position lies within the loader's epoch: the next pass skips that many batches, so
    a hostile count (2**40) would keep the run busy for ever."""
    if saved is None or not getattr(loader, "use_stateful_dataloader", False):
        return
    try:
        limit = len(loader)
    except TypeError:  # a stream without a length: its position is only bounded as a counter
        limit = None

    def check(value: Any):
        if isinstance(value, dict):
            for key, item in value.items():
                if key in POSITION_COUNTERS:
                    _expect(_is_int(item) and (limit is None or item <= limit), f"snapshot {snapshot}: state.json",
                            f"a dataloader position {key}={str(item)[:40]} outside its epoch of {limit} batches")
                check(item)

    check(saved)


def _agree(error: Exception | None, doing: str) -> None:
    """Every process raises if any failed `doing` (none is left waiting in a later collective)."""
    if error is not None and not isinstance(error, TriaxError):
        error = AcceleratorRuntimeError(f"load_state failed while {doing}: {type(error).__name__}: {error}")
    with raise_together(f"{doing} in load_state", AcceleratorRuntimeError):
        if error is not None:
            raise error


def _check_counts(held: Checkpointed, state: dict, snapshot: str, loaded: list[int], units: list[dict]) -> None:
    checks = [("models", state["saved_models"], loaded),
              ("schedulers", len(state["schedulers"]), len(held.schedulers)),
              ("registered objects", len(state["custom"]), len(held.custom_objects)),
              ("optimizers", len(state["optimizer_steps"]), len(held.optimizers)),
              ("optimizer states", len(state["stateless_optimizers"]), len(held.optimizers)),
              ("[models, their optimizers] per snapshot", state["units"], _unit_signature(units))]
    for what, saved, now in checks:
        if saved != now:
            raise AcceleratorValueError(f"{snapshot!r} holds {what} {str(saved)[:120]} but this run has {now}; "
                                        "prepare (and register, and hook) the same objects before load_state")


def _read_checked_state(held: Checkpointed, snapshot: str, loaded: list[int]) -> tuple[dict, list, dict]:
    """(the Accelerator's section of the snapshot's state.json, validated; the snapshot's units; the
    JSON-encoded states decoded), after checking they fit what this run prepared. Reads only."""
    try:
        document = read_state(snapshot)
    except RecursionError:
        raise StateCorruptError(f"snapshot {snapshot}: state.json is nested too deeply to be a saved state") from None
    section = document.get("accelerator") if isinstance(document, dict) else None
    if section is None:
        raise StateCorruptError(f"{snapshot!r} is a triax snapshot but not one written by "
                                "Accelerator.save_state")
    state = validate_state(section, snapshot)
    units = snapshot_units(held.models, held.optimizers, loaded)
    _check_counts(held, state, snapshot, loaded, units)
    wrong = bad_number(section)
    if wrong is not None:
        raise StateCorruptError(f"snapshot {snapshot}: state.json is corrupt: it holds {wrong[:120]}, "
                                "outside what that field allows")
    decoded = {key: [from_json(item, f"snapshot {snapshot}: state.json {key}") for item in state[key]]
               for key in ("schedulers", "custom", "stateless_optimizers", "dataloaders")}
    for saved, scheduler in zip(decoded["schedulers"], held.schedulers):
        _check_scheduler(saved, scheduler.state_dict(), snapshot)
    for saved, loader in zip(decoded["dataloaders"], held.dataloaders):
        _check_dataloader_position(saved, loader, snapshot)
    decoded["scaler"] = from_json(state["scaler"], f"snapshot {snapshot}: state.json scaler")
    return state, units, decoded


def load_state(held: Checkpointed, path: str, loaded: list[int]) -> str:
    # First everything that can fail locally (a missing or hostile file, a mismatch with what was
    # prepared), agreed on by every process before any collective or any change to the run.
    error, snapshot, state = None, None, None
    try:
        snapshot = resolve_snapshot(path)
        state, units, decoded = _read_checked_state(held, snapshot, loaded)
    except Exception as failure:  # agreed first, then raised as it is (or wrapped) on every process
        error = failure
    _agree(error, "reading the saved state")

    stateless = decoded["stateless_optimizers"]
    in_snapshot = [saved is None for saved in stateless]  # saved with the tensors unless saved as JSON
    root = os.path.dirname(snapshot)
    error = None
    try:
        for index in range(1, len(units)):
            _read_snapshot(os.path.join(root, f"model_{index}", os.path.basename(snapshot)), units[index]["module"],
                           _snapshot_optimizer(held, units[index], in_snapshot), restore_rng=False)
        # Last, so the random-number generators are left exactly as they were at save time.
        _read_snapshot(snapshot, units[0]["module"], _snapshot_optimizer(held, units[0], in_snapshot),
                       restore_rng=True)
        for optimizer, saved in zip(held.optimizers, stateless):
            if saved is not None:
                optimizer.optimizer.load_state_dict(saved)
        for scheduler, saved in zip(held.schedulers, decoded["schedulers"]):
            scheduler.load_state_dict(saved)
        held.grad_scaler.load_state_dict(decoded["scaler"])
        for loader, saved in zip(held.dataloaders, decoded["dataloaders"]):
            if saved is not None and getattr(loader, "use_stateful_dataloader", False):
                loader.load_state_dict(saved)
        for obj, saved in zip(held.custom_objects, decoded["custom"]):
            obj.load_state_dict(saved)
    except Exception as failure:
        error = failure
    _agree(error, "loading the saved state")
    for optimizer, steps in zip(held.optimizers, state["optimizer_steps"]):
        optimizer.num_steps = steps
    held.gradient_state.micro_step = state["micro_step"]
    return snapshot
