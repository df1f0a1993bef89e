"""Saving and loading the Accelerator's state, and a model's weights.

`StateSaving` keeps what save_state adds to the prepared objects (the objects registered for
checkpointing, the save and load pre-hooks), decides the folder (explicit, automatic naming, or
`<project_dir>/checkpoints`) and hands the writing and reading to the folder formats:
Accelerate's folder (_internal/accelerate_folder.py, _internal/fsdp_folder.py) and triax's
snapshots (_internal/saving.py). Those formats are given what a checkpoint holds (`Checkpointed`:
the prepared objects, the registered ones, the scaler, the step counters), not the Accelerator.

get_state_dict and save_model write one model's weights, outside any checkpoint folder.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.hooks import RemovableHandle

from triax.accelerate._internal import accelerate_folder, checkpoints
from triax.accelerate._internal.checkpointed import Checkpointed
from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorValueError
from triax.accelerate._internal.prepared_models import extract_model_from_parallel, offloaded_state_dict
from triax.accelerate._internal.saving import load_state as load_snapshot_state
from triax.accelerate.utils import operations
from triax.runtime.failure_agreement import raise_together

if TYPE_CHECKING:
    from triax.accelerate._internal.gradient_sync import GradientSync
    from triax.accelerate._internal.preparation import Preparation
    from triax.accelerate.utils.dataclasses import ProjectConfiguration


def get_state_dict(model: torch.nn.Module) -> dict:
    """The full, name-keyed state of a (possibly wrapped or sharded) model, on CPU; weights that
    offloading hooks keep off the model (on the meta device) are read from the hooks."""
    if any(tensor.is_meta for tensor in model.state_dict().values()):
        return offloaded_state_dict(extract_model_from_parallel(model))
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_model(state: dict, save_directory: str, safe_serialization: bool, is_main_process: bool) -> str | None:
    """Write `state` into save_directory on the main process. A collective: if the main process
    cannot write, every process raises."""
    path, error = None, None
    if is_main_process:
        try:
            path = write_weights(state, save_directory, safe_serialization)
        except OSError as failure:
            error = AcceleratorRuntimeError(f"save_model could not write to {save_directory!r} "
                                            f"({type(failure).__name__}: {failure.strerror or failure})")
    with raise_together("saving the model (save_model)", AcceleratorRuntimeError):
        if error is not None:
            raise error
    return path


def write_weights(state: dict, save_directory: str, safe_serialization: bool) -> str:
    os.makedirs(save_directory, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file  # deferred: only safe_serialization writes safetensors

        path = os.path.join(save_directory, "model.safetensors")
        # Tied weights share storage, which safetensors refuses: give each name a copy.
        save_file({name: tensor.detach().clone().contiguous() for name, tensor in state.items()}, path)
    else:
        path = os.path.join(save_directory, "pytorch_model.bin")
        torch.save(state, path)
    return path


class StateSaving:
    """save_state, load_state and what they save besides the prepared objects."""

    def __init__(self, prepared: Preparation, project: ProjectConfiguration, gradient_sync: GradientSync):
        self.prepared = prepared
        self.project = project
        self.custom_objects: list = []
        self.checkpointed = Checkpointed(prepared, gradient_sync, self.custom_objects)
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to them (plain dicts refuse).
        self.save_pre_hooks: OrderedDict = OrderedDict()
        self.load_pre_hooks: OrderedDict = OrderedDict()

    def register_for_checkpointing(self, objects: tuple) -> None:
        invalid = [f"Item at index {index} ({type(obj).__name__})" for index, obj in enumerate(objects)
                   if not all(callable(getattr(obj, method, None)) for method in ("state_dict", "load_state_dict"))]
        if invalid:
            raise AcceleratorValueError(f"register_for_checkpointing needs objects with state_dict() and "
                                        f"load_state_dict(); {', '.join(invalid)} lack them: wrap each in an object "
                                        "that has both")
        self.custom_objects.extend(objects)

    @staticmethod
    def register_hook(hooks: OrderedDict, hook: Callable) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def checkpoint_root(self, directory: str | None, for_save: bool) -> str:
        project = self.project
        if directory is not None and not (for_save and project.automatic_checkpoint_naming):
            # As Accelerate, automatic naming decides where save_state writes, whatever it is given.
            # A snapshot is one directory that every process writes its part of: process 0's
            # (a script may name a different one per process, e.g. each process's own tempdir).
            return operations.broadcast_object_list([os.path.expanduser(str(directory))])[0]
        if project.automatic_checkpoint_naming:
            if for_save:
                return checkpoints.next_automatic_dir(project, self.prepared.state.is_main_process)
            return checkpoints.latest_automatic_dir(project)
        if project.project_dir is None:
            raise AcceleratorValueError("save_state/load_state without a directory need "
                                        "Accelerator(project_dir=...) or automatic_checkpoint_naming")
        return os.path.join(project.project_dir, "checkpoints")

    def save_state(self, output_dir: str | None, safe_serialization: bool) -> str:
        root = self.checkpoint_root(output_dir, for_save=True)
        prepared_models = self.prepared.models
        models = list(prepared_models)
        # As Accelerate, the models' own names: its list holds each model as given to prepare,
        # without DDP's "module." or torch.compile's "_orig_mod.".
        weights = [extract_model_from_parallel(model, keep_torch_compile=False).state_dict()
                   for model in prepared_models]
        before_hooks = list(weights)
        for hook in self.save_pre_hooks.values():
            hook(models, weights, root)
        kept_weights = {id(weight) for weight in weights}
        saved = [index for index, model in enumerate(prepared_models)
                 if any(model is m for m in models) and id(weights[index]) in kept_weights]
        if self.prepared.state.is_fsdp2:
            path = accelerate_folder.save_folder(self.checkpointed, root, [], safe_serialization, fsdp_models=saved)
        else:
            path = accelerate_folder.save_folder(self.checkpointed, root, [before_hooks[index] for index in saved],
                                                 safe_serialization)
        self.project.iteration += 1
        return path

    def load_state(self, input_dir: str | None) -> str:
        if input_dir is not None:
            input_dir = operations.broadcast_object_list([os.path.expanduser(str(input_dir))])[0]
        if input_dir is not None and not os.path.isdir(input_dir):
            raise AcceleratorValueError(f"load_state: {input_dir!r} is not a directory")
        root = self.checkpoint_root(input_dir, for_save=False)
        prepared_models = self.prepared.models
        models = list(prepared_models)
        for hook in self.load_pre_hooks.values():
            hook(models, root)
        loaded = [index for index, model in enumerate(prepared_models) if any(model is m for m in models)]
        if accelerate_folder.is_accelerate_folder(root):
            return accelerate_folder.load_folder(self.checkpointed, root, [prepared_models[index] for index in loaded],
                                                 fsdp=self.prepared.state.is_fsdp2)
        return load_snapshot_state(self.checkpointed, root, loaded)
