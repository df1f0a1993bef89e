"""The user's models as the Accelerator prepared them: unwrapping them, and saving or loading their
weights on the right process (not triax's own models: triax/models/). Accelerate's helpers, under
its names (re-exported by triax.accelerate.utils)."""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.fsdp import FullyShardedDataParallel

from triax.accelerate._internal.errors import AcceleratorValueError
from triax.accelerate.state import PartialState

logger = logging.getLogger(__name__)


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether `module` is what torch.compile(model) returned."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether some submodule of `module` (or itself) was compiled with torch.compile."""
    return bool(module._modules) and any(is_compiled_module(child) for child in module.modules())


# The wrappers whose real model is their `.module` (FSDP version 1 is one; FSDP2 wraps nothing).
PARALLEL_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel, FullyShardedDataParallel)


def remove_precision_wrapper(model: torch.nn.Module) -> None:
    """Give `model` back the forward it had before mixed precision wrapped it: triax's autocast
    wrapper (prepare), or a forward kept in `_original_forward` by Accelerate's convention
    (`model._original_forward = model.forward; model.forward = convert_outputs_to_fp32(...)`)."""
    forward = model.__dict__.get("forward")
    if forward is not None and getattr(forward, "__wrapped_by_triax__", False):
        del model.forward
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is type(model).forward:
        model.__dict__.pop("forward", None)  # the class's own forward again
    else:
        model.forward = original if isinstance(original, types.MethodType) else types.MethodType(original, model)


def extract_model_from_parallel(model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False):
    """The model inside DistributedDataParallel / DataParallel / FSDP (version 1) wrappers.
    keep_fp32_wrapper=False also removes the mixed-precision forward wrapper; keep_torch_compile
    keeps a torch.compile wrapper around the result (its inner module replaced by the unwrapped
    one), else the compiled model's original module is returned. recursive also unwraps children
    that hold their real module as `.module`."""
    compiled = model if is_compiled_module(model) else None
    if compiled is not None:
        model = model._orig_mod
    while isinstance(model, PARALLEL_WRAPPERS):
        model = model.module
    if recursive:
        model = _unwrap_children(model)
    if not keep_fp32_wrapper:
        remove_precision_wrapper(model)
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    return model


def _unwrap_children(module: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    for name, child in list(module.named_children()):
        setattr(module, name, _unwrap_children(child))
    return module


def _without_shared_storage(state: dict) -> dict:
    """A state dict safetensors accepts: of the names sharing one storage (tied weights) only the
    first is kept, and the others are named in one warning."""
    seen, kept, removed = {}, {}, []
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            kept[name] = tensor
            continue
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key in seen and tensor.numel():
            removed.append(f"{name} (shares memory with {seen[key]})")
            continue
        seen.setdefault(key, name)
        kept[name] = tensor.contiguous()
    if removed:
        logger.warning("Removed shared tensor %s while saving: safetensors stores each storage once; tie the "
                       "weights again after loading", ", ".join(removed))
    return kept


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """torch.save (or safetensors' save_file with safe_serialization, shared tensors written once)
    on the main process, or with save_on_each_node on each machine's local main process."""
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if safe_serialization:
        save_file(_without_shared_storage(dict(obj)), f, metadata={"format": "pt"})
    else:
        torch.save(obj, f)


def load(f: Any, map_location: Any = None, **kwargs: Any):
    """torch.load, reading tensors and plain containers only unless weights_only=False is passed."""
    kwargs.setdefault("weights_only", True)
    return torch.load(f, map_location=map_location, **kwargs)


def _offload_hooks(module: torch.nn.Module) -> list:
    """The hooks on `module` that keep its weights elsewhere (Accelerate's big-model dispatch puts
    an offloading hook with a `weights_map` on it, alone or inside a SequentialHook)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = list(getattr(hook, "hooks", ())) if hook is not None and hasattr(hook, "hooks") else [hook]
    return [hook for hook in hooks
            if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None]


def offloaded_state_dict(model: torch.nn.Module) -> dict:
    """model.state_dict() on the CPU, where the tensors an offloading hook keeps elsewhere (they sit
    on the meta device in the model) are read from the hook's weights map, one at a time."""
    state = {}
    holders = {name: _offload_hooks(module) for name, module in model.named_modules()}
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            tensor = _read_offloaded(name, holders)
        state[name] = tensor.detach().cpu()
    return state


def _read_offloaded(name: str, holders: dict) -> torch.Tensor:
    # The deepest module above `name` whose hook has it; the hook's map is keyed relative to that module.
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        prefix, local = ".".join(parts[:depth]), ".".join(parts[depth:])
        for hook in holders.get(prefix, []):
            if local in hook.weights_map:
                return hook.weights_map[local]
    raise AcceleratorValueError(f"the model's {name} is on the meta device and no offloading hook holds its "
                                "value; load the weights before saving")
