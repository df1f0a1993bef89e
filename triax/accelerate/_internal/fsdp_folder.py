"""Accelerate's checkpoint layout under FSDP2, written and read as Accelerate 1.x's save_state and
load_state do (accelerate/utils/fsdp_utils.py), so an FSDP run moves between the two mid-training:

    SHARDED_STATE_DICT (FSDP2's default)
        pytorch_model_fsdp_<i>/    a torch.distributed.checkpoint (DCP) folder of {"model": model i's
                                   state dict}, each process writing and reading its own shards
        optimizer_<i>/             a DCP folder of {"optimizer": optimizer i's state dict over model i}
    FULL_STATE_DICT
        pytorch_model_fsdp.bin     torch.save of model i's whole state dict, by process 0
                                   (pytorch_model_fsdp_<i>.bin after the first)
        optimizer.bin              torch.save of optimizer i's whole state dict (optimizer_<i>.bin)

beside the files every layout has (scheduler.bin, random_states_<rank>.pkl, custom_checkpoint_<i>.pkl,
triax's manifest: accelerate_folder.py). Accelerate pairs optimizer i with model i; so does this.

A DCP folder's `.metadata` is a pickle, and DCP's planner unpickles its non-tensor entries (the
optimizer's param_groups) with no restriction: triax reads the metadata through its checked reader
(triax/interop/torchtitan/checkpoint.py) and those entries through torch's weights-only loader, so a folder
that needs more is refused in one line. The manifest records each DCP file's size and sha256; a
resume checks the sizes and the metadata's digest (hashing every shard would read the whole
checkpoint once more).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import triax.safe_files as safe_files
from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorValueError
from triax.accelerate._internal.fsdp import FULL, state_dict_type
from triax.accelerate._internal.saving import _agree
from triax.interop.shared.pickled import PickledFileError, load_pickled_bytes, pickled_bytes
from triax.interop.torchtitan.checkpoint import METADATA_FILE, CheckedReader, read_metadata
from triax.interop.hf.files import CheckpointError

if TYPE_CHECKING:
    from triax.accelerate._internal.checkpointed import Checkpointed

MODEL, OPTIMIZER = "pytorch_model_fsdp", "optimizer"
FULL_OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_name(index: int, full: bool) -> str:
    if full:
        return f"{MODEL}.bin" if index == 0 else f"{MODEL}_{index}.bin"
    return f"{MODEL}_{index}"


def optimizer_name(index: int, full: bool) -> str:
    if full:
        return f"{OPTIMIZER}.bin" if index == 0 else f"{OPTIMIZER}_{index}.bin"
    return f"{OPTIMIZER}_{index}"


def is_fsdp_folder(path: str) -> bool:
    """A folder Accelerate (or triax) saved under FSDP."""
    return any(os.path.lexists(os.path.join(path, name)) for name in (model_name(0, True), model_name(0, False)))


def _full(held: Checkpointed) -> bool:
    return state_dict_type(held.state.fsdp_plugin) == FULL


# ---- writing ----------------------------------------------------------------------------------


def save_parts(held: Checkpointed, output_dir: str, saved: list[int], digest: Callable[[bytes], dict]) -> dict:
    """Write models `saved` and every optimizer in the layout the plugin's state_dict_type names;
    returns {file name within output_dir: digest(bytes)} of the files this process wrote. Collective."""
    full, rank, written = _full(held), held.process_index, {}

    def put(name: str, state: Any) -> None:  # a whole state dict, by process 0
        if rank == 0:
            data = pickled_bytes(state)
            safe_files.write_atomic(os.path.join(output_dir, name), data)
            written[name] = digest(data)

    def put_sharded(name: str, key: str, state: Any) -> None:
        folder = os.path.join(output_dir, name)
        try:
            dcp.save({key: state}, storage_writer=dcp.FileSystemWriter(folder))
        except CheckpointException as error:
            cause = next(iter(error.failures.values()))[0] if error.failures else error
            raise OSError(f"{folder}: {cause}") from None
        for entry in sorted(os.listdir(folder)):  # this process's shards; process 0 also the metadata
            if entry.startswith(f"__{rank}_") or (rank == 0 and entry == METADATA_FILE):
                with safe_files.open_read(os.path.join(folder, entry)) as handle:
                    written[f"{name}/{entry}"] = digest(handle.read())

    for index in saved:
        model = held.models[index]
        if full:
            put(model_name(index, True), get_model_state_dict(model, options=FULL_OPTIONS))
        else:
            put_sharded(model_name(index, False), "model", get_model_state_dict(model))
    for index, optimizer in enumerate(held.optimizers):
        model = _model_of(held, index)
        if full:
            put(optimizer_name(index, True), get_optimizer_state_dict(model, optimizer.optimizer, options=FULL_OPTIONS))
        else:
            put_sharded(optimizer_name(index, False), "optimizer", get_optimizer_state_dict(model, optimizer.optimizer))
    return written


def _model_of(held: Checkpointed, index: int):
    if index >= len(held.models):
        raise AcceleratorValueError(f"optimizer {index} has no model {index} to be saved with: under FSDP, "
                                    "Accelerate's checkpoint pairs optimizer i with model i; prepare one model per "
                                    "optimizer")
    return held.models[index]


# ---- reading ----------------------------------------------------------------------------------


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, but a folder's non-tensor entries (param_groups) are read through torch's
    weights-only loader, never unpickled as they come."""

    def load_bytes(self, read_item: Callable, value: io.BytesIO) -> None:
        loaded = load_pickled_bytes(value.read(), f"an entry ({read_item.dest_index.fqn}) of a DCP folder")
        super().load_bytes(read_item, io.BytesIO(pickled_bytes(loaded)))


class Staged:
    """What load_parts read for one model or optimizer, applied once everything is read and checked."""

    def __init__(self, apply: Callable):
        self.apply = apply


def _checked_folder(folder: Any, name: str):
    """The checked metadata of DCP folder `name`, its files matched against the manifest's sizes
    and its metadata's digest."""
    path = os.path.join(folder.path, name)
    if not safe_files.is_directory(path):
        raise PickledFileError(f"{path} is missing or not a directory; the checkpoint was saved without "
                               "FSDP's sharded state dict (state_dict_type), or is incomplete")
    try:
        metadata = read_metadata(path)
    except CheckpointError as error:
        raise PickledFileError(str(error)) from None
    for entry, record in ((folder.manifest or {}).get("files") or {}).items():
        if not entry.startswith(name + "/"):
            continue
        local = os.path.join(folder.path, entry)
        if safe_files.stored_bytes(local) != record.get("bytes"):
            raise PickledFileError(f"{local} is {safe_files.stored_bytes(local)} bytes, the manifest says "
                                   f"{record.get('bytes')}; the checkpoint is damaged: use an earlier one")
        if entry.endswith("/" + METADATA_FILE):
            folder.verify(entry)
    return metadata, path


def _read_sharded(metadata: Any, path: str, key: str, target: dict) -> dict:
    """Read DCP folder `path`'s `key` into copies of `target`'s tensors (the live ones change only
    when applied). Collective."""
    copies = {key: _copy(target)}
    try:
        dcp.load(copies, storage_reader=CheckedReader(path, metadata), planner=_WeightsOnlyPlanner())
    except CheckpointException as error:
        cause = next(iter(error.failures.values()))[0] if error.failures else error
        if isinstance(cause, PickledFileError):
            raise PickledFileError(str(cause)) from None
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
        raise PickledFileError(f"{path} does not fit the prepared model and optimizer ({first[:200]}); prepare "
                               "what the checkpoint was saved from") from None
    return copies[key]


def _copy(value: Any):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


def load_parts(held: Checkpointed, folder: Any, models: list) -> list[Staged]:
    """Read the models' and optimizers' saved state; returns what to apply. Collective: first
    every process checks what it will read (metadata, the whole files process 0 reads) and all
    agree, then DCP reads the shards (and agrees on its own failures)."""
    full, rank, error = _full(held), held.process_index, None
    parts = [(model_name(index, full), "model", model, None, f"model {index}'s weights")
             for index, model in enumerate(models)]
    parts += [(optimizer_name(index, full), "optimizer", _model_of(held, index), optimizer.optimizer,
               f"optimizer {index}'s state") for index, optimizer in enumerate(held.optimizers)]
    checked = []
    try:
        for name, _, _, _, what in parts:
            if not full:
                checked.append(_checked_folder(folder, name))
            else:
                checked.append(folder.pickled(name, what) if rank == 0 else {})
    except Exception as failure:  # agreed first, then raised on every process
        error = failure
    _agree(error, "reading an Accelerate FSDP checkpoint")
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    staged = []
    for (name, key, model, optimizer, _), found in zip(parts, checked):
        if full:
            options, state = broadcast, found
        else:
            own = get_model_state_dict(model) if optimizer is None else get_optimizer_state_dict(model, optimizer)
            options, state = None, _read_sharded(*found, key, own)
        if optimizer is None:
            staged.append(Staged(lambda m=model, s=state, o=options: set_model_state_dict(m, s, options=o)))
        else:
            staged.append(Staged(lambda m=model, p=optimizer, s=state, o=options:
                                 set_optimizer_state_dict(m, p, s, options=o)))
    return staged


def apply(staged: list[Staged]) -> None:
    try:
        for part in staged:
            part.apply()
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        raise AcceleratorRuntimeError(f"the checkpoint's FSDP state does not fit the prepared model or optimizer "
                                      f"({type(error).__name__}: {str(error)[:200]})") from None
