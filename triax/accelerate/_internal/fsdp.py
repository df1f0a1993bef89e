"""FSDP the Accelerate way: a FullyShardedDataParallelPlugin (triax's or Accelerate's own) read
into what triax's FSDP2 core (triax.parallel.fsdp) does, option by option.

`read_plugin` runs when the Accelerator is built: every option is honoured, or refused there in one
line naming it (or, for an FSDP1 option FSDP2 has no counterpart for, named in one warning).
`shard_model` runs in `prepare`: it picks the FSDP units as Accelerate 1.15's FSDP2 path does
(the wrap policy's modules bottom-up, the input embedding alone, the final norm and output
embedding together, the root last), checkpoints the wrapped modules' activations, and, for
`cpu_ram_efficient_loading` / `sync_module_states`, gives every shard process 0's weights.
docs/accelerate.md#fsdp has the table.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from triax.accelerate._internal.errors import AcceleratorTypeError, AcceleratorValueError, UnsupportedFeatureError
from triax.accelerate._internal.fsdp_plugin import PRECISION_DTYPES, FullyShardedDataParallelPlugin, find_layer_classes
from triax.parallel.activation_checkpoint import apply_activation_checkpointing
from triax.parallel.fsdp import each_block, offload_policy, shard_units, sharded_parameter_device
from triax.runtime.failure_agreement import raise_together

FULL, SHARDED = "FULL_STATE_DICT", "SHARDED_STATE_DICT"


@dataclasses.dataclass
class FSDPSettings:
    """What the plugin asks of triax's FSDP2 core, in plain values."""

    reshard_after_forward: bool
    cpu_offload: bool
    pin_memory: bool
    mixed_precision_policy: Any  # torch's MixedPrecisionPolicy, or None: from the Accelerator's mixed_precision
    auto_wrap_policy: Any  # as the plugin normalises it (None: no wrap), or triax's each_block
    transformer_cls_names_to_wrap: list | None
    min_num_params: int
    activation_checkpointing: bool
    activation_checkpointing_offload: bool
    weights_from_rank0: bool  # cpu_ram_efficient_loading or sync_module_states
    ignored_modules: Any
    forward_prefetch: bool
    param_init_fn: Any


def default_plugin():
    """`parallel="fsdp"` without a plugin: FSDP2 with each block of the model its own unit (the
    other options from the FSDP_* environment, as for any plugin)."""
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=each_block)


def _name(value: Any) -> str:
    return str(getattr(value, "name", value))


def state_dict_type(plugin: Any) -> str:
    """FULL_STATE_DICT or SHARDED_STATE_DICT, read when saving (a script may change it before a
    final save with plugin.set_state_dict_type)."""
    kind = _name(plugin.state_dict_type).upper()
    if kind not in (FULL, SHARDED):
        raise AcceleratorValueError(f"FSDP state_dict_type={kind} is not supported; use FULL_STATE_DICT or "
                                    "SHARDED_STATE_DICT (FSDP2 has no LOCAL_STATE_DICT)")
    return kind


def _reshard_after_forward(plugin: Any) -> bool:
    """FSDP2's bool, or FSDP1's sharding strategy mapped as `accelerate to-fsdp2` maps it."""
    value = plugin.reshard_after_forward
    if isinstance(value, bool):
        return value
    strategy = _name(value if value is not None else plugin.sharding_strategy).upper()
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return strategy == "FULL_SHARD"
    if strategy == "NO_SHARD":
        raise UnsupportedFeatureError("FullyShardedDataParallelPlugin(sharding_strategy=NO_SHARD) is not supported: "
                                      "triax runs FSDP2, which always shards; use parallel='ddp' (no sharding)")
    raise UnsupportedFeatureError(f"FullyShardedDataParallelPlugin(sharding_strategy={strategy}) is not supported "
                                  "by the Accelerator (it needs a 2-D mesh); use `triax train` with "
                                  "parallel.dp_replicate x parallel.dp_shard (HSDP), or FULL_SHARD")


def _offload(plugin: Any) -> tuple[bool, bool]:
    """(offload to host memory, pin it): FSDP2's OffloadPolicy, or FSDP1's CPUOffload."""
    value = plugin.cpu_offload
    if isinstance(value, bool):
        return value, True
    if isinstance(value, CPUOffloadPolicy):
        return True, value.pin_memory
    if isinstance(value, OffloadPolicy):
        return False, False
    if hasattr(value, "offload_params"):  # FSDP1's CPUOffload
        return bool(value.offload_params), True
    raise AcceleratorTypeError(f"FullyShardedDataParallelPlugin(cpu_offload={value!r}) must be a bool, "
                               "CPUOffloadPolicy or OffloadPolicy")


def _mixed_precision(plugin: Any):
    """FSDP2's MixedPrecisionPolicy as it is; FSDP1's MixedPrecision as its FSDP2 counterpart."""
    policy = plugin.mixed_precision_policy
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    if not hasattr(policy, "buffer_dtype"):
        raise AcceleratorTypeError(f"FullyShardedDataParallelPlugin(mixed_precision_policy={policy!r}) must be a "
                                   "MixedPrecisionPolicy, a name (bf16, fp16, fp32) or a dict of dtypes")
    if getattr(policy, "keep_low_precision_grads", False):
        raise UnsupportedFeatureError("MixedPrecision(keep_low_precision_grads=True) is not supported: FSDP2 gives "
                                      "gradients in the parameters' dtype; drop it")
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                                cast_forward_inputs=policy.cast_forward_inputs)


def _fsdp1_notes(plugin: Any) -> list[str]:
    """FSDP1 options FSDP2 has no counterpart for, where they are set to something FSDP2 does not do."""
    notes = []
    if plugin.backward_prefetch is not None and _name(plugin.backward_prefetch).upper() != "BACKWARD_PRE":
        notes.append(f"backward_prefetch={_name(plugin.backward_prefetch)} (FSDP2 prefetches as BACKWARD_PRE)")
    if plugin.use_orig_params is False:
        notes.append("use_orig_params=False (FSDP2 always trains the original parameters)")
    buffer_dtype = getattr(plugin.mixed_precision_policy, "buffer_dtype", None)
    if buffer_dtype not in (None, torch.float32):
        notes.append(f"mixed precision buffer_dtype={buffer_dtype} (FSDP2 leaves buffers in their dtype)")
    return notes


def read_plugin(plugin: Any) -> FSDPSettings:
    """Check a FullyShardedDataParallelPlugin and say what it asks for; refuses in one line what
    triax cannot do."""
    if type(plugin).__name__ != "FullyShardedDataParallelPlugin":
        raise AcceleratorTypeError(f"`fsdp_plugin` must be a FullyShardedDataParallelPlugin object (triax's or "
                                   f"Accelerate's), got a {type(plugin).__name__}")
    if plugin.fsdp_version not in (1, 2):
        raise AcceleratorValueError(f"fsdp_version={plugin.fsdp_version!r} is not an FSDP version; use 2")
    reshard = _reshard_after_forward(plugin)
    cpu_offload, pin_memory = _offload(plugin)
    mixed_precision = _mixed_precision(plugin)
    state_dict_type(plugin)
    notes = _fsdp1_notes(plugin) if plugin.fsdp_version == 1 else []
    if plugin.fsdp_version == 1:
        warnings.warn("FullyShardedDataParallelPlugin(fsdp_version=1): triax runs FSDP2 (fully_shard), with the "
                      "FSDP1 options mapped as `accelerate to-fsdp2` maps them"
                      + (f"; not applied: {', '.join(notes)}" if notes else ""), stacklevel=5)
    if plugin.limit_all_gathers is False:
        warnings.warn("FullyShardedDataParallelPlugin(limit_all_gathers=False) is not applied: FSDP2 bounds its "
                      "in-flight all-gathers itself", stacklevel=5)
    if plugin.activation_checkpointing and plugin.auto_wrap_policy is None:
        raise AcceleratorValueError("FullyShardedDataParallelPlugin(activation_checkpointing=True) checkpoints the "
                                    "modules the auto_wrap_policy wraps, and there are none (NO_WRAP); set "
                                    "auto_wrap_policy='transformer_based_wrap' or 'size_based_wrap'")
    return FSDPSettings(
        reshard_after_forward=reshard, cpu_offload=cpu_offload, pin_memory=pin_memory,
        mixed_precision_policy=mixed_precision, auto_wrap_policy=plugin.auto_wrap_policy,
        transformer_cls_names_to_wrap=plugin.transformer_cls_names_to_wrap,
        min_num_params=plugin.min_num_params or 0,
        activation_checkpointing=bool(plugin.activation_checkpointing),
        activation_checkpointing_offload=bool(plugin.activation_checkpointing_offload),
        weights_from_rank0=bool(plugin.cpu_ram_efficient_loading or plugin.sync_module_states),
        ignored_modules=plugin.ignored_modules, forward_prefetch=bool(plugin.forward_prefetch),
        param_init_fn=plugin.param_init_fn)


# ---- which modules become FSDP units -------------------------------------------------------------

def bottom_up(model: nn.Module) -> list[nn.Module]:
    """Every submodule of `model` (not the model itself), children before their parents."""
    order, stack = [], list(model.children())
    while stack:
        module = stack.pop()
        order.append(module)
        stack.extend(module.children())
    return order[::-1]


def wrapped_modules(settings: FSDPSettings, model: nn.Module) -> list[nn.Module]:
    """The modules the auto wrap policy makes units of, bottom-up (Accelerate's FSDP2 rules)."""
    policy = settings.auto_wrap_policy
    function = policy.func if isinstance(policy, functools.partial) else policy
    bound = policy.keywords if isinstance(policy, functools.partial) else {}
    if policy is None:
        return []
    if function is each_block:
        return each_block(model)
    if function is transformer_auto_wrap_policy:
        classes = bound.get("transformer_layer_cls")
        if classes is None:
            names = settings.transformer_cls_names_to_wrap
            classes = find_layer_classes(model, list(getattr(model, "_no_split_modules", None) or [])
                                         if names is None else names)
        return [module for module in bottom_up(model) if classes and isinstance(module, tuple(classes))]
    if function is size_based_auto_wrap_policy:
        minimum = bound.get("min_num_params", settings.min_num_params)
        if not minimum:  # Accelerate: 0 means no size-based wrapping
            return []
        return [module for module in bottom_up(model) if sum(p.numel() for p in module.parameters()) > minimum]
    if not callable(policy):
        raise AcceleratorTypeError(f"FullyShardedDataParallelPlugin(auto_wrap_policy={policy!r}) must be "
                                   "'transformer_based_wrap', 'size_based_wrap', 'no_wrap' or a callable")
    # Any other callable follows FSDP1's contract: asked bottom-up about each module, with the
    # number of its parameters no unit below it has taken yet.
    chosen, taken = [], set()
    for module in bottom_up(model):
        remaining = sum(p.numel() for p in module.parameters() if id(p) not in taken)
        if policy(module=module, recurse=False, nonwrapped_numel=remaining):
            chosen.append(module)
            taken.update(id(p) for p in module.parameters())
    return chosen


def _embedding_units(model: nn.Module, units: list[nn.Module]) -> tuple[list, list]:
    """A transformers model's input embedding as a unit of its own, and its final norm with the
    output embedding as one unit kept gathered to the end of forward (with the input embedding
    too when the two share their weight: a shared parameter belongs to one unit)."""
    def lookup(method: Callable):
        try:
            return getattr(model, method, lambda: None)()
        except (NotImplementedError, AttributeError):
            return None

    inside = {id(m) for unit in units for m in unit.modules()}
    input_embed, output_embed = lookup("get_input_embeddings"), lookup("get_output_embeddings")
    weight = getattr(input_embed, "weight", None)
    tied = weight is not None and weight is getattr(output_embed, "weight", None)
    first = [input_embed] if input_embed is not None and not tied and id(input_embed) not in inside else []
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    norms = [m for _, m in base.named_children() if "Norm" in type(m).__name__] if isinstance(base, nn.Module) else []
    tail = [norms[-1] if norms else None] + ([input_embed] if tied else []) + [output_embed]
    tail = [m for m in tail if m is not None and id(m) not in inside]
    if input_embed is None:  # not a transformers-style model: nothing to carve out
        return [], []
    return first, [tail] if tail else []


# ---- process 0's weights into every shard ---------------------------------------------------------

def _non_persistent_buffers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(module, name) for module in model.modules() for name in module._non_persistent_buffers_set
            if module._buffers.get(name) is not None]


def _to_meta(model: nn.Module) -> None:
    """Every parameter and buffer onto the meta device (no memory), keeping shared ones shared."""
    memo = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is not None and id(tensor) not in memo:
                    empty = torch.empty_like(tensor, device="meta")
                    memo[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else empty)
                if tensor is not None:
                    table[name] = memo[id(tensor)]


def _load_from_rank0(model: nn.Module, full_state: dict, buffers: list, device: torch.device) -> None:
    """Allocate this process's shards only (the model is on the meta device), then every shard
    and every buffer takes process 0's values (torch's broadcast_from_rank0)."""
    model.to_empty(device=device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for (module, name), value in buffers:
        value = torch.empty_like(value, device=device) if value.is_meta else value.to(device).clone()
        dist.broadcast(value, src=0)
        module._buffers[name] = value


# ---- prepare --------------------------------------------------------------------------------------

def _ignored_parameters(settings: FSDPSettings, model: nn.Module, device: torch.device) -> set | None:
    """The parameters of `ignored_modules` (modules, or a regular expression their names must match
    in full), moved to the device: FSDP2 neither shards them nor reduces their gradients."""
    modules = settings.ignored_modules
    if modules is None:
        return None
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
    parameters = set()
    for module in modules:
        if not any(p.is_meta for p in module.parameters()):  # meta ones are allocated with the shards
            module.to(device)
        parameters.update(module.parameters())
    return parameters


def default_mixed_precision_policy(mixed_precision: str):
    """Accelerate's rule for FSDP under Accelerator(mixed_precision=...): parameters and gradient
    reduction in that dtype; outputs left in the dtype they are computed in (Accelerate 1.16)."""
    dtype = PRECISION_DTYPES.get(mixed_precision)
    if dtype is None or dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


def shard_model(model: nn.Module, settings: FSDPSettings, mesh: object | None, device: torch.device,
                mixed_precision: str, rank: int) -> nn.Module:
    """Apply the plugin's FSDP2 to `model` in place (collective). `mixed_precision` is the
    Accelerator's effective one ("no", "bf16", "fp16")."""
    if settings.param_init_fn is not None:  # FSDP1's hook for modules built on the meta device
        for module in model.modules():
            if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
                settings.param_init_fn(module)
    if mixed_precision != "no":
        # FSDP2 needs one dtype per unit: low-precision trainable weights become fp32 master
        # weights, and the policy casts them for compute (as Accelerate does).
        for parameter in model.parameters():
            if parameter.requires_grad and parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()
    # Agreed by every process before any collective: one process alone raising would leave the
    # others waiting in their first all-gather.
    with raise_together("preparing the model for FSDP", AcceleratorValueError):
        units = wrapped_modules(settings, model)
        if not settings.weights_from_rank0 and any(p.is_meta for p in model.parameters()):
            raise AcceleratorValueError("prepare got a model with parameters on the meta device (no values); give "
                                        "FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True) to load "
                                        "process 0's weights into every shard, or build the model with its weights")
    if settings.activation_checkpointing:
        apply_activation_checkpointing(model, "full", blocks=units, offload=settings.activation_checkpointing_offload)
    first, last = _embedding_units(model, units)
    full_state, buffers = None, []
    if settings.weights_from_rank0:
        full_state = model.state_dict() if rank == 0 else {}
        buffers = [(entry, entry[0]._buffers[entry[1]]) for entry in _non_persistent_buffers(model)]
        _to_meta(model)
    ignored = _ignored_parameters(settings, model, device)  # the parameters as they are now (meta ones too)
    policy = settings.mixed_precision_policy or default_mixed_precision_policy(mixed_precision)
    shard_units(model, mesh, units + first, mp_policy=policy, reshard_after_forward=settings.reshard_after_forward,
                offload=offload_policy(settings.cpu_offload, device.type, settings.pin_memory),
                ignored_params=ignored, last_units=last)
    if settings.weights_from_rank0:
        _load_from_rank0(model, full_state, buffers, sharded_parameter_device(device, settings.cpu_offload))
    if settings.forward_prefetch:
        ordered = [m for m in model.modules() if any(m is unit for unit in units + first)]
        for unit, following in zip(ordered, ordered[1:]):
            unit.set_modules_to_forward_prefetch([following])
    return model
