"""Accelerator(dynamo_backend=...) and dynamo_plugin: torch.compile applied to each prepared model, last
(after DDP or FSDP), as Accelerate does, with the plugin's settings; a model already compiled is left as
it is. Accelerate's regional compilation (compiling each repeated block) is refused with what to do."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from triax.accelerate._internal.errors import AcceleratorValueError, UnsupportedFeatureError
from triax.accelerate._internal.prepared_models import is_compiled_module
from triax.accelerate.utils.dataclasses import DynamoBackend
from triax.accelerate._internal.flags import parse_flag_from_env

# torch.compile's own defaults: only settings that differ from them are passed (as Accelerate's to_kwargs).
COMPILE_DEFAULTS = {"mode": "default", "fullgraph": False, "dynamic": None, "options": None, "disable": False}
# What `accelerate launch` sets for a dynamo section of its config file.
ENVIRONMENT_PREFIX = "ACCELERATE_DYNAMO_"


def _backend(value: object) -> DynamoBackend:
    name = str(getattr(value, "value", value)).upper()
    if name not in DynamoBackend.__members__:
        raise AcceleratorValueError(f"dynamo_backend={value!r} is not a torch.compile backend Accelerate names; use "
                                    f"one of {', '.join(member.lower() for member in DynamoBackend.__members__)}")
    return DynamoBackend(name)


def resolve_dynamo(dynamo_backend: object | None, dynamo_plugin: object | None) -> SimpleNamespace:
    """The compilation settings from the Accelerator's arguments (a backend name, or Accelerate's
    TorchDynamoPlugin or any object with its fields), else from ACCELERATE_DYNAMO_* in the environment."""
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise AcceleratorValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only "
                                    "pass in one.")
    if dynamo_plugin is not None:
        settings = {name: getattr(dynamo_plugin, name, default) for name, default in COMPILE_DEFAULTS.items()}
        backend = getattr(dynamo_plugin, "backend", None) or "no"
        regional = bool(getattr(dynamo_plugin, "use_regional_compilation", False))
    else:
        backend = dynamo_backend or os.environ.get(ENVIRONMENT_PREFIX + "BACKEND", "no")
        dynamic = ENVIRONMENT_PREFIX + "USE_DYNAMIC"  # unset: torch decides (None), as Accelerate
        settings = {"mode": os.environ.get(ENVIRONMENT_PREFIX + "MODE", "default"),
                    "fullgraph": parse_flag_from_env(ENVIRONMENT_PREFIX + "USE_FULLGRAPH"),
                    "dynamic": parse_flag_from_env(dynamic) if dynamic in os.environ else None,
                    "options": None, "disable": False}
        regional = parse_flag_from_env(ENVIRONMENT_PREFIX + "USE_REGIONAL_COMPILATION")
    plugin = SimpleNamespace(backend=_backend(backend), use_regional_compilation=regional, **settings)
    if regional and plugin.backend != DynamoBackend.NO:
        raise UnsupportedFeatureError("use_regional_compilation=True: triax does not compile a model's repeated "
                                      "blocks one by one; compile the blocks yourself (torch.compile on each) "
                                      "before prepare, or leave it off to compile the whole model")
    return plugin


def compile_model(model: torch.nn.Module, plugin: SimpleNamespace) -> torch.nn.Module:
    """torch.compile(model) with the plugin's backend and the settings that differ from torch's defaults."""
    if plugin.backend == DynamoBackend.NO or is_compiled_module(model):
        return model
    options = {name: getattr(plugin, name) for name, default in COMPILE_DEFAULTS.items()
               if getattr(plugin, name) != default}
    return torch.compile(model, backend=plugin.backend.value.lower(), **options)
