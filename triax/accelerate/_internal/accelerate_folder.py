"""Accelerate's checkpoint folder, written and read as Accelerate 1.x does, so a run moves from
Accelerate to triax and back mid-training.

The folder (Accelerate's names; `_<i>` after the first of each kind):
    model.safetensors | pytorch_model.bin   each saved model's state_dict (safe_serialization)
    optimizer.bin, scheduler.bin            torch.save of each one's state_dict (main process)
    dl_state_dict.bin                       a StatefulDataLoader's position (use_stateful_dataloader)
    scaler.pt                               the GradScaler's state, fp16 only
    random_states_<rank>.pkl                every process: step, Python's, numpy's and torch's RNG
    custom_checkpoint_<i>.pkl               each object given to register_for_checkpointing
    triax_loose_parameters.safetensors      triax's addition: parameters an optimizer steps that no
                                            prepared model holds (Accelerate saves their optimizer
                                            state but not their values, so they would restart)
    triax_manifest.json                     triax's addition, written last: size and sha256 of
                                            every file above, and the counters Accelerate keeps
                                            nowhere (optimizer updates, micro-step)
Accelerate also writes sampler.bin, a pickled SeedableRandomSampler object, for an iterable
dataset it shards itself; reading it would mean unpickling a class, so triax neither writes nor
reads it (docs/switching.md).

Reading goes through torch's weights-only loader only (triax.interop.shared.pickled); a folder with
a manifest has every file checked against it, one without (Accelerate wrote it) is read as it is.
Every process agrees on the outcome of a save or a load, so a failure on one never leaves the
others waiting.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors.torch
import torch

import triax.safe_files as safe_files
from triax.accelerate._internal import fsdp_folder
from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorValueError
from triax.accelerate._internal.saving import _agree, _check_dataloader_position, _check_scheduler
from triax.checkpoint.numbers import COUNTERS, RANGES, bad_number
from triax.interop.shared.pickled import PickledFileError, pickled_bytes, read_pickled, read_whole
from triax.runtime.failure_agreement import raise_together
from triax.runtime.shared_decisions import all_gather_bytes
from triax.runtime.process_group import is_distributed
from triax.runtime.shared_decisions import all_gather_bytes

if TYPE_CHECKING:
    from triax.accelerate._internal.checkpointed import Checkpointed

MANIFEST = "triax_manifest.json"
LOOSE = "triax_loose_parameters.safetensors"
FORMAT = "triax-accelerate-folder/1"
SAFE_WEIGHTS, WEIGHTS = "model.safetensors", "pytorch_model.bin"
CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
# Prefixes a wrapper adds to a model's parameter names: DDP's and torch.compile's. A folder from a
# 2-process Accelerate run holds "module.<name>"; the same model in one process has "<name>".
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def numbered(name: str, index: int) -> str:
    """Accelerate's name for the index-th file of a kind: optimizer.bin, optimizer_1.bin, ..."""
    stem, dot, extension = name.partition(".")
    return name if index == 0 else f"{stem}_{index}{dot}{extension}"


def is_accelerate_folder(path: str) -> bool:
    """Whether `path` holds a checkpoint in Accelerate's layout (written by either library)."""
    names = (SAFE_WEIGHTS, WEIGHTS, "optimizer.bin", "random_states_0.pkl", MANIFEST)
    return any(os.path.lexists(os.path.join(path, name)) for name in names) or fsdp_folder.is_fsdp_folder(path)


# ---- writing ----------------------------------------------------------------------------------


def _model_file(state: dict, safe_serialization: bool) -> bytes:
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    if not safe_serialization:
        return pickled_bytes(state)
    # safetensors refuses tensors that share memory (tied weights): keep the first name of each,
    # as Accelerate does; loading ties them again.
    seen, kept = set(), {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        kept[name] = tensor
    return safetensors.torch.save(kept, metadata={"format": "pt"})


def _rng_state(step: int) -> dict:
    state = {"step": step, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
             "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def _main_files(held: Checkpointed, weights: list[dict], safe_serialization: bool,
                fsdp: bool) -> dict[str, bytes]:
    """Process 0's files; under FSDP the models and optimizers are fsdp_folder's."""
    files = {}
    for index, state in enumerate(weights):
        files[numbered(SAFE_WEIGHTS if safe_serialization else WEIGHTS, index)] = _model_file(state, safe_serialization)
    for index, optimizer in enumerate(held.optimizers if not fsdp else ()):
        files[numbered("optimizer.bin", index)] = pickled_bytes(optimizer.state_dict())
    for index, scheduler in enumerate(held.schedulers):
        files[numbered("scheduler.bin", index)] = pickled_bytes(scheduler.state_dict())
    for index, loader in enumerate(held.dataloaders):
        if getattr(loader, "use_stateful_dataloader", False):
            files[numbered("dl_state_dict.bin", index)] = pickled_bytes(loader.state_dict())
    if held.scaler is not None:  # Accelerate has a scaler only for fp16
        files["scaler.pt"] = pickled_bytes(held.scaler.state_dict())
    for index, obj in enumerate(held.custom_objects):
        files[f"custom_checkpoint_{index}.pkl"] = pickled_bytes(obj.state_dict())
    loose = {} if fsdp else {name: parameter.detach().cpu().contiguous()
                             for name, parameter in _loose_parameters(held)}
    if loose:
        files[LOOSE] = safetensors.torch.save(loose)
    return files


def _loose_parameters(held: Checkpointed) -> list[tuple[str, torch.nn.Parameter]]:
    """("optimizer_<i>.<j>", parameter) for each parameter an optimizer steps that no prepared model holds."""
    owned = {id(parameter) for model in held.models for parameter in model.parameters()}
    found = []
    for number, optimizer in enumerate(held.optimizers):
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        found += [(f"optimizer_{number}.{index}", p) for index, p in enumerate(parameters) if id(p) not in owned]
    return found


def _digest(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_folder(held: Checkpointed, output_dir: str, weights: list[dict], safe_serialization: bool,
                fsdp_models: list[int] | None = None) -> str:
    """Write Accelerate's files for `weights` (the state dicts left after the save hooks) and the
    Accelerator's optimizers, schedulers, dataloaders, scaler, RNG and registered objects into
    output_dir, then triax's manifest. Under FSDP (`fsdp_models`: the indices of the models to
    save) the models and optimizers go in Accelerate's FSDP layout (fsdp_folder.py). Collective;
    returns output_dir."""
    rank, fsdp = held.process_index, fsdp_models is not None
    written = {}
    with raise_together("writing an Accelerate checkpoint folder (save_state)", AcceleratorRuntimeError):
        try:
            if held.is_main_process:
                safe_files.make_directory(output_dir)
        finally:
            if is_distributed():
                torch.distributed.barrier()  # the folder exists before any other process writes
        try:
            if fsdp:
                written.update(fsdp_folder.save_parts(held, output_dir, fsdp_models, _digest))
            files = _main_files(held, weights, safe_serialization, fsdp) if held.is_main_process else {}
            files[f"random_states_{rank}.pkl"] = pickled_bytes(_rng_state(held.step))
            for name, data in files.items():
                safe_files.write_atomic(os.path.join(output_dir, name), data)
                written[name] = _digest(data)
        except OSError as error:
            raise AcceleratorRuntimeError(f"save_state could not write to {output_dir!r} "
                                          f"({type(error).__name__}: {error.strerror or error})") from None
    everyone = [json.loads(part) for part in all_gather_bytes(json.dumps(written).encode())] \
        if is_distributed() else [written]
    with raise_together("writing the checkpoint's manifest (save_state)", AcceleratorRuntimeError):
        if held.is_main_process:
            manifest = {"format": FORMAT, "files": {name: entry for part in everyone for name, entry in part.items()},
                        "optimizer_steps": [optimizer.num_steps for optimizer in held.optimizers],
                        "micro_step": held.gradient_state.micro_step}
            safe_files.write_atomic(os.path.join(output_dir, MANIFEST), json.dumps(manifest, indent=1))
    return output_dir


# ---- reading ----------------------------------------------------------------------------------


def _read_manifest(folder: str) -> dict | None:
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        return None  # written by Accelerate, which keeps no manifest
    try:
        manifest = safe_files.read_json(path)
    except (ValueError, UnicodeDecodeError):
        raise PickledFileError(f"{path} is not valid JSON; the checkpoint is damaged") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (manifest.get("format") if isinstance(manifest, dict) else None) != FORMAT or not isinstance(files, dict) \
            or not all(isinstance(entry, dict) and isinstance(entry.get("sha256"), str) for entry in files.values()):
        raise PickledFileError(f"{path} is not a manifest triax wrote (format {FORMAT}); the checkpoint is damaged")
    for name in files:
        if not os.path.lexists(os.path.join(folder, name)):
            raise PickledFileError(f"{os.path.join(folder, name)} is missing though the manifest lists it; the "
                                   "checkpoint is incomplete: use an earlier one")
    return manifest


class _Folder:
    """One checkpoint folder, each file read through the weights-only loader and checked against
    the manifest where there is one."""

    def __init__(self, path: str):
        self.path = path
        self.manifest = _read_manifest(path)

    def expected(self, name: str) -> str | None:
        entry = (self.manifest or {}).get("files", {}).get(name)
        return entry["sha256"] if entry else None

    def exists(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.path, name))

    def verify(self, name: str) -> None:
        """File `name` matches the manifest's sha256 (if it lists it)."""
        expected = self.expected(name)
        if expected is not None:
            with safe_files.open_read(os.path.join(self.path, name)) as handle:
                if hashlib.sha256(handle.read()).hexdigest() != expected:
                    raise PickledFileError(f"{os.path.join(self.path, name)} does not match the sha256 its folder's "
                                           "manifest records; restore it or use an earlier checkpoint")

    def pickled(self, name: str, what: str, numpy_rng: bool = False):
        return read_pickled(os.path.join(self.path, name), what, numpy_rng, self.expected(name))

    def weights(self, index: int) -> dict:
        safe = numbered(SAFE_WEIGHTS, index)
        if not self.exists(safe):
            state = self.pickled(numbered(WEIGHTS, index), f"model {index}'s weights")
            if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise PickledFileError(f"{os.path.join(self.path, numbered(WEIGHTS, index))} does not hold a "
                                       "state_dict of tensors")
            return state
        return self.safetensors(safe)

    def safetensors(self, name: str) -> dict:
        path = os.path.join(self.path, name)
        data = read_whole(path, "weights")
        if self.expected(name) is not None and hashlib.sha256(data).hexdigest() != self.expected(name):
            raise PickledFileError(f"{path} does not match the sha256 its folder's manifest records; restore it "
                                   "or use an earlier checkpoint")
        try:
            return safetensors.torch.load(data)
        except Exception as error:  # safetensors raises its own SafetensorError for any malformed header
            raise PickledFileError(f"{path} is not a readable safetensors file ({str(error)[:160]})") from None


def _plain(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _load_model(model: torch.nn.Module, saved: dict, where: str) -> None:
    """Load `saved` into the model whatever wrappers either side had (DDP's module., compile's
    _orig_mod.); a name the model lacks, or a missing one that is not a tied alias, is an error."""
    own = model.state_dict()
    by_plain = {_plain(name): name for name in own}
    unknown = [name for name in saved if _plain(name) not in by_plain]
    if unknown:
        raise AcceleratorValueError(f"{where} holds {unknown[:3]} ({len(unknown)} names) that the prepared model "
                                    "lacks; prepare the same model the checkpoint was saved from")
    renamed = {by_plain[_plain(name)]: tensor for name, tensor in saved.items()}
    for name, tensor in renamed.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise AcceleratorValueError(f"{where}: {name} has shape {tuple(tensor.shape)} but the prepared model's "
                                        f"is {tuple(own[name].shape)}; prepare the model the checkpoint was saved from")
    missing = model.load_state_dict(renamed, strict=False).missing_keys
    loaded_storage = {own[name].untyped_storage().data_ptr() for name in renamed}
    untied = [name for name in missing if own[name].untyped_storage().data_ptr() not in loaded_storage]
    if untied:
        raise AcceleratorValueError(f"{where} lacks {untied[:3]} ({len(untied)} names) of the prepared model; "
                                    "prepare the same model the checkpoint was saved from")


def _check_custom_count(folder: _Folder, registered: int) -> None:
    found = [name for name in os.listdir(folder.path) if CUSTOM.match(name)]
    if len(found) != registered:
        raise AcceleratorRuntimeError(f"{folder.path} holds {len(found)} custom_checkpoint_<i>.pkl files but "
                                      f"{registered} objects are registered for checkpointing; register the same "
                                      "objects the checkpoint was saved with")


def load_folder(held: Checkpointed, path: str, models: list, fsdp: bool = False) -> str:
    """Restore what an Accelerate checkpoint folder holds into `models` (those no load hook took
    over) and the Accelerator's optimizers, schedulers, dataloaders, scaler, RNG and registered
    objects; with `fsdp`, the models and optimizers from Accelerate's FSDP layout. Everything is
    read and checked before anything changes. Collective."""
    error, staged = None, None
    try:
        folder = _Folder(path)
        _check_custom_count(folder, len(held.custom_objects))
        if fsdp != fsdp_folder.is_fsdp_folder(path):
            raise AcceleratorValueError(f"{path} was saved {'without' if fsdp else 'with'} FSDP; load it into what it "
                                        f"was saved from (this run {'shards' if fsdp else 'does not shard'} its model)")
        staged = _read_staged(held, folder, len(models), fsdp)
        _check_staged(held, staged, path)
    except Exception as failure:  # agreed first, then raised on every process
        error = failure
    _agree(error, "reading an Accelerate checkpoint folder")
    sharded = fsdp_folder.load_parts(held, folder, models) if fsdp else []

    error = None
    try:
        fsdp_folder.apply(sharded)
        _apply_staged(held, staged, models, path)
    except Exception as failure:
        error = failure
    _agree(error, "loading an Accelerate checkpoint folder")
    if staged["rng"] is not None:
        _restore_rng(held, staged["rng"])
    _restore_counters(held, folder.manifest or {})
    return path


def _read_staged(held: Checkpointed, folder: _Folder, model_count: int, fsdp: bool) -> dict:
    """Everything the folder holds for this Accelerator, read (and checked against the manifest)
    but not yet applied; under FSDP the models and optimizers are read by fsdp_folder instead."""
    rng_name = f"random_states_{held.process_index}.pkl"
    return {
        "models": [] if fsdp else [folder.weights(index) for index in range(model_count)],
        "optimizers": [] if fsdp else [folder.pickled(numbered("optimizer.bin", i), f"optimizer {i}'s state")
                                       for i in range(len(held.optimizers))],
        "schedulers": [folder.pickled(numbered("scheduler.bin", i), f"scheduler {i}'s state")
                       for i in range(len(held.schedulers))],
        "dataloaders": [folder.pickled(numbered("dl_state_dict.bin", i), f"dataloader {i}'s position")
                        if getattr(loader, "use_stateful_dataloader", False)
                        and folder.exists(numbered("dl_state_dict.bin", i)) else None
                        for i, loader in enumerate(held.dataloaders)],
        "scaler": folder.pickled("scaler.pt", "the loss scaler's state")
        if held.scaler is not None and folder.exists("scaler.pt") else None,
        "custom": [folder.pickled(f"custom_checkpoint_{i}.pkl", f"registered object {i}'s state")
                   for i in range(len(held.custom_objects))],
        # As Accelerate: a process without its RNG file (a run resumed on more processes)
        # keeps its random states.
        "rng": folder.pickled(rng_name, "random states", numpy_rng=True) if folder.exists(rng_name) else None,
        "loose": folder.safetensors(LOOSE) if folder.exists(LOOSE) else {},
    }


def _check_staged(held: Checkpointed, staged: dict, path: str) -> None:
    """Every state read from the folder fits what it will be loaded into, before any is loaded."""
    _check_loose(staged["loose"], held, path)
    for index, (saved, scheduler) in enumerate(zip(staged["schedulers"], held.schedulers)):
        _check_scheduler(saved, scheduler.state_dict(), path, os.path.join(path, numbered("scheduler.bin", index)))
        _check_numbers(saved, f"{path} scheduler")
    for saved in staged["optimizers"]:
        if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
            raise PickledFileError(f"{path}: an optimizer file does not hold an optimizer's state_dict")
        _check_numbers({"param_groups": saved["param_groups"]}, f"{path} optimizer")
    for saved, loader in zip(staged["dataloaders"], held.dataloaders):
        _check_dataloader_position(saved, loader, path)
    if staged["rng"] is not None:
        _check_rng(staged["rng"], path)


def _apply_staged(held: Checkpointed, staged: dict, models: list, path: str) -> None:
    """Load the checked states into the models, optimizers, schedulers, dataloaders, scaler,
    registered objects and loose parameters (the RNG is restored after every process agrees)."""
    for index, (model, saved) in enumerate(zip(models, staged["models"])):
        _load_model(model, saved, f"{path} model {index}")
    for optimizer, saved in zip(held.optimizers, staged["optimizers"]):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(held.schedulers, staged["schedulers"]):
        scheduler.load_state_dict(saved)
    for loader, saved in zip(held.dataloaders, staged["dataloaders"]):
        if saved is not None:
            loader.load_state_dict(saved)
    if staged["scaler"] is not None:
        held.scaler.load_state_dict(staged["scaler"])
    for obj, saved in zip(held.custom_objects, staged["custom"]):
        obj.load_state_dict(saved)
    with torch.no_grad():
        for name, parameter in _loose_parameters(held):
            if name in staged["loose"]:
                parameter.copy_(staged["loose"][name])


def _restore_counters(held: Checkpointed, manifest: dict) -> None:
    """The counters Accelerate keeps nowhere (optimizer updates, micro-step), from triax's manifest
    when it holds sane ones; a folder Accelerate wrote leaves them as they are."""
    steps = manifest.get("optimizer_steps")
    if isinstance(steps, list) and len(steps) == len(held.optimizers) \
            and all(isinstance(n, int) and 0 <= n < 2**62 for n in steps):
        for optimizer, count in zip(held.optimizers, steps):
            optimizer.num_steps = count
    if isinstance(manifest.get("micro_step"), int) and 0 <= manifest["micro_step"] < 2**62:
        held.gradient_state.micro_step = manifest["micro_step"]


def _check_loose(saved: dict, held: Checkpointed, path: str) -> None:
    current = dict(_loose_parameters(held))
    for name, tensor in saved.items():
        if name not in current or tuple(tensor.shape) != tuple(current[name].shape):
            raise PickledFileError(f"{path}: {LOOSE} holds {name} {list(tensor.shape)}, which no optimizer of this "
                                   "run steps outside its models; prepare the same optimizers before load_state")


def _check_numbers(state: Any, where: str) -> None:
    """Learning rates, betas, counters...: finite and in range (triax.checkpoint.numbers). Only
    the fields with a range are checked: a plateau scheduler's best may be inf on purpose."""
    def ranged(value: Any):
        if isinstance(value, dict):
            return {key: ranged(item) if isinstance(item, (dict, list)) else item for key, item in value.items()
                    if key in RANGES or key in COUNTERS or isinstance(item, (dict, list))}
        return [ranged(item) for item in value] if isinstance(value, list) else value

    wrong = bad_number(ranged(state)) if isinstance(state, dict) else None
    if wrong is not None:
        raise PickledFileError(f"{where} is corrupt: it holds {wrong[:120]}, outside what that field allows")


def _check_rng(state: Any, path: str) -> None:
    """An RNG file's fields have the types Accelerate writes (torch's state a uint8 tensor, numpy's
    a 5-tuple), so restoring cannot fail half-way."""
    good = isinstance(state, dict) and isinstance(state.get("torch_manual_seed"), torch.Tensor) \
        and state["torch_manual_seed"].dtype == torch.uint8 and isinstance(state.get("random_state"), tuple) \
        and isinstance(state.get("numpy_random_seed"), tuple) and len(state["numpy_random_seed"]) == 5 \
        and isinstance(state.get("step", 0), int)
    if not good:
        raise PickledFileError(f"{path}: the random states file does not hold Accelerate's step, random_state, "
                               "numpy_random_seed and torch_manual_seed; it is damaged")


def _restore_rng(held: Checkpointed, state: dict) -> None:
    held.step = state.get("step", held.step)
    try:
        random.setstate(state["random_state"])
        np.random.set_state(state["numpy_random_seed"])
        torch.set_rng_state(state["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in state:
            torch.cuda.set_rng_state_all(state["torch_cuda_manual_seed"])
    except (TypeError, ValueError, RuntimeError) as error:
        raise PickledFileError(f"the random states file holds states that cannot be restored ({error})") from None

