"""Accelerate's FullyShardedDataParallelPlugin, with its fields, defaults and environment.

A field left at None is read from the `FSDP_*` variable `accelerate launch --use_fsdp` (or
`triax launch --config_file <accelerate config>`) sets, then falls back to Accelerate's default,
and is normalised to the torch object Accelerate 1.15 stores (`StateDictType`, `OffloadPolicy`,
`MixedPrecisionPolicy`, torch's wrap-policy functions ...). A script reading
`accelerator.state.fsdp_plugin.state_dict_type` therefore sees what it would see under Accelerate,
and triax.accelerate._internal.fsdp reads this class and Accelerate's own one through the same normalised
fields. What triax does with each option (it always runs FSDP2, `fully_shard`) is decided there.

Differences from Accelerate, both because the option can be honoured with FSDP2:
`sync_module_states` is kept with fsdp_version=2 (Accelerate drops it: triax broadcasts process
0's weights into the shards), and `forward_prefetch=True` is accepted with fsdp_version=2
(Accelerate raises: triax asks FSDP2 to prefetch the next unit's all-gather).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import warnings
from typing import Any, Callable

import torch
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from triax.accelerate._internal.errors import AcceleratorValueError
from triax.accelerate._internal.flags import check_accelerate_environment
from triax.launch.variables import AUTO_WRAP_POLICIES, BACKWARD_PREFETCHES, SHARDING_STRATEGIES, check_value

ENV_PREFIX = "FSDP_"
# Accelerate's mixed-precision names -> dtypes (fp8 trains with bf16 weights there too).
PRECISION_DTYPES = {"fp8": torch.bfloat16, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def str_to_bool(value: str, name: str) -> bool:
    """Accelerate's reading of a true/false value of option `name` (anything else is an error)."""
    text = str(value).lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True
    if text in ("n", "no", "f", "false", "off", "0"):
        return False
    raise AcceleratorValueError(f"{name}={value!r} is not a truth value; use true or false")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + name, default)


def _env_bool(name: str, default: str = "false") -> bool:
    return str_to_bool(_env(name, default), ENV_PREFIX + name)


def _sharding_strategy(value: Any):
    """A name, a number (1 = FULL_SHARD ...) or torch's enum -> torch's ShardingStrategy."""
    if isinstance(value, ShardingStrategy):
        return value
    text = str(value).upper()
    if text in SHARDING_STRATEGIES:  # torch spells the last one _HYBRID_SHARD_ZERO2: go by number
        return ShardingStrategy(SHARDING_STRATEGIES.index(text) + 1)
    if text.isdigit() and len(text) < 3 and 1 <= int(text) <= len(SHARDING_STRATEGIES):
        return ShardingStrategy(int(text))
    raise AcceleratorValueError(f"sharding strategy {value!r} is not one of {', '.join(SHARDING_STRATEGIES)}")


def find_layer_classes(model: torch.nn.Module, names: list[str]) -> set:
    """The classes named `names` among `model`'s modules (transformer_cls_names_to_wrap)."""
    found = {type(module).__name__: type(module) for module in model.modules()}
    missing = [name for name in names if name not in found]
    if missing:
        raise AcceleratorValueError(f"Could not find the transformer layer class {', '.join(missing)} in the model "
                                    f"(transformer_cls_names_to_wrap); it has {', '.join(sorted(found))[:300]}")
    return {found[name] for name in names}


def enable_fsdp_ram_efficient_loading() -> None:
    """Have transformers' from_pretrained load weights on process 0 only, under FSDP (the
    variables it reads; the Accelerator then gives every shard process 0's values)."""
    os.environ.setdefault("ACCELERATE_USE_FSDP", "True")
    os.environ[ENV_PREFIX + "CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    os.environ[ENV_PREFIX + "CPU_RAM_EFFICIENT_LOADING"] = "False"


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's fields, in its order. What each does in triax: docs/accelerate.md#fsdp."""

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None

    def __post_init__(self):
        obsolete = []  # Accelerate's deprecation notes, given in one log record
        check_accelerate_environment()
        if self.fsdp_version is None:
            self.fsdp_version = int(_env("VERSION", "1"))
        if self.fsdp_version not in (1, 2):
            raise AcceleratorValueError(f"fsdp_version={self.fsdp_version!r} is not an FSDP version; use 2 "
                                        "(FSDP2, fully_shard) or 1")
        if self.sharding_strategy is not None:
            obsolete.append("sharding_strategy is deprecated in favor of reshard_after_forward")
        elif self.fsdp_version == 1:
            self.sharding_strategy = _env("SHARDING_STRATEGY", "FULL_SHARD")
        if self.sharding_strategy is not None:
            self.sharding_strategy = _sharding_strategy(self.sharding_strategy)
        self._set_reshard_after_forward()
        if self.cpu_offload is None:
            self.cpu_offload = _env_bool("OFFLOAD_PARAMS")
        self.set_cpu_offload()
        self.validate_cpu_offload()
        self._set_backward_prefetch(obsolete)
        self.set_state_dict_type()
        self._set_auto_wrap_policy()
        if self.fsdp_version == 1:
            for name in ("use_orig_params", "sync_module_states", "forward_prefetch"):
                if getattr(self, name) is None:
                    setattr(self, name, _env_bool(name.upper()))
        elif self.use_orig_params is not None:
            obsolete.append("use_orig_params is obsolete in FSDP2, as FSDP2 always uses the original parameters")
            self.use_orig_params = None
        if self.activation_checkpointing is None:
            self.activation_checkpointing = _env_bool("ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = _env_bool("ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            raise AcceleratorValueError("`activation_checkpointing_offload=True` requires `activation_checkpointing=True`.")
        if self.activation_checkpointing_offload and self.fsdp_version != 2:
            raise AcceleratorValueError("`activation_checkpointing_offload=True` requires `fsdp_version=2`.")
        if self.ignored_modules is None:
            self.ignored_modules = _env("IGNORED_MODULES")
        elif isinstance(self.ignored_modules, str):  # compiled at prepare: a bad pattern fails now
            check_value("FSDP_IGNORED_MODULES", self.ignored_modules, "ignored_modules", AcceleratorValueError)
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = _env_bool("CPU_RAM_EFFICIENT_LOADING")
        else:
            # transformers' from_pretrained reads it: only process 0 then loads the weights.
            os.environ[ENV_PREFIX + "CPU_RAM_EFFICIENT_LOADING"] = str(self.cpu_ram_efficient_loading)
        if self.fsdp_version == 1 and self.cpu_ram_efficient_loading and not self.sync_module_states:
            warnings.warn("sync_module_states cannot be False since efficient cpu ram loading enabled. "
                          "Setting sync_module_states to True.", stacklevel=3)
            self.sync_module_states = True
        if isinstance(self.mixed_precision_policy, str):
            self.set_mixed_precision(self.mixed_precision_policy, override=True)
        elif isinstance(self.mixed_precision_policy, dict):
            self.set_mixed_precision(self.mixed_precision_policy)
        if self.mixed_precision_policy is not None:
            self.validate_mixed_precision_policy()
        if obsolete:
            # A log record, as Accelerate gives these notes (they change nothing FSDP2 does).
            logging.getLogger(__name__).warning("FullyShardedDataParallelPlugin: " + "; ".join(obsolete))

    # ---- normalisation, one field at a time (Accelerate's rules) -------------------------------------

    def _set_reshard_after_forward(self) -> None:
        if self.reshard_after_forward is None and self.sharding_strategy is None:
            self.reshard_after_forward = _env("RESHARD_AFTER_FORWARD", "true" if self.fsdp_version == 2 else "FULL_SHARD")
        if isinstance(self.reshard_after_forward, str):
            self.reshard_after_forward = (str_to_bool(self.reshard_after_forward, "reshard_after_forward")
                                          if self.fsdp_version == 2
                                          else _sharding_strategy(self.reshard_after_forward))
        if self.fsdp_version == 2 and self.reshard_after_forward is not None \
                and not isinstance(self.reshard_after_forward, bool):
            raise AcceleratorValueError(f"reshard_after_forward set to {self.reshard_after_forward}. This is not "
                                        "supported with FSDP2, please set to a `bool`")
        if self.fsdp_version == 1 and isinstance(self.reshard_after_forward, bool):
            raise AcceleratorValueError(f"reshard_after_forward set to {self.reshard_after_forward}. This is not "
                                        "supported with FSDP1, please set to a `str` or a ShardingStrategy")

    def _set_backward_prefetch(self, obsolete: list) -> None:
        if self.backward_prefetch is None:
            self.backward_prefetch = _env("BACKWARD_PREFETCH")
        if isinstance(self.backward_prefetch, str) and self.backward_prefetch.upper() == "NO_PREFETCH":
            self.backward_prefetch = None
        if self.backward_prefetch is not None and not isinstance(self.backward_prefetch, BackwardPrefetch):
            text = str(self.backward_prefetch).upper()
            if text in BACKWARD_PREFETCHES:
                self.backward_prefetch = BackwardPrefetch[text]
            elif text.isdigit():
                self.backward_prefetch = BackwardPrefetch(int(text))
            else:
                raise AcceleratorValueError(f"backward_prefetch={self.backward_prefetch!r} is not one of "
                                            f"{', '.join(BACKWARD_PREFETCHES)}")
        if self.fsdp_version == 2 and self.backward_prefetch is not None:
            obsolete.append("backward_prefetch is not supported in FSDP2 (it prefetches in backward by itself); "
                            "setting it to None")
            self.backward_prefetch = None

    def _set_auto_wrap_policy(self) -> None:
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = _env("AUTO_WRAP_POLICY", "NO_WRAP")
        if not isinstance(self.auto_wrap_policy, str):
            return
        name = self.auto_wrap_policy.upper()
        if name not in AUTO_WRAP_POLICIES:
            raise AcceleratorValueError(f"Invalid auto wrap policy: {self.auto_wrap_policy}. Must be one of "
                                        f"{list(AUTO_WRAP_POLICIES)}")
        if name == "TRANSFORMER_BASED_WRAP":
            self.auto_wrap_policy = transformer_auto_wrap_policy
            if self.transformer_cls_names_to_wrap is None:
                self.transformer_cls_names_to_wrap = _env("TRANSFORMER_CLS_TO_WRAP")
            if isinstance(self.transformer_cls_names_to_wrap, str):
                self.transformer_cls_names_to_wrap = self.transformer_cls_names_to_wrap.split(",")
        elif name == "SIZE_BASED_WRAP":
            self.auto_wrap_policy = size_based_auto_wrap_policy
            if self.min_num_params is None:
                self.min_num_params = int(_env("MIN_NUM_PARAMS", "0"))
            elif not isinstance(self.min_num_params, int):
                raise AcceleratorValueError(f"`min_num_params` must be an integer. Got {self.min_num_params} of "
                                            f"type {type(self.min_num_params)}")
        else:
            self.auto_wrap_policy = None

    # ---- Accelerate's public methods ----------------------------------------------------------------

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Set (or change, e.g. to FULL_STATE_DICT before a final save) the state dict type."""
        if state_dict_type is not None:
            self.state_dict_type = state_dict_type
        if self.state_dict_type is None:
            self.state_dict_type = _env("STATE_DICT_TYPE", "FULL_STATE_DICT" if self.fsdp_version == 1
                                        else "SHARDED_STATE_DICT")
        if isinstance(self.state_dict_type, str):
            text = self.state_dict_type.upper()
            try:
                self.state_dict_type = StateDictType(int(text)) if text.isdigit() else StateDictType[text]
            except (KeyError, ValueError):
                raise AcceleratorValueError(f"state_dict_type={self.state_dict_type!r} is not one of "
                                            "FULL_STATE_DICT, SHARDED_STATE_DICT, LOCAL_STATE_DICT") from None
        if self.state_dict_type == StateDictType.FULL_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
        elif self.state_dict_type == StateDictType.SHARDED_STATE_DICT:
            if self.state_dict_config is None:
                self.state_dict_config = ShardedStateDictConfig(offload_to_cpu=True)
            if self.optim_state_dict_config is None:
                self.optim_state_dict_config = ShardedOptimStateDictConfig(offload_to_cpu=True)
        if self.fsdp_version == 2 and self.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            raise AcceleratorValueError("FSDP2 does not support LOCAL_STATE_DICT. Please set `fsdp_state_dict_type` "
                                        "to `SHARDED_STATE_DICT` or `FULL_STATE_DICT`.")

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Bind the wrap policy to `model`'s classes, as Accelerate does before wrapping (the
        transformer classes default to the model's `_no_split_modules`)."""
        if self.auto_wrap_policy is transformer_auto_wrap_policy:
            if self.transformer_cls_names_to_wrap is None:
                self.transformer_cls_names_to_wrap = list(getattr(model, "_no_split_modules", None) or [])
            classes = find_layer_classes(model, self.transformer_cls_names_to_wrap)
            self.auto_wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        elif self.auto_wrap_policy is size_based_auto_wrap_policy:
            self.auto_wrap_policy = (functools.partial(size_based_auto_wrap_policy, min_num_params=self.min_num_params)
                                     if self.min_num_params > 0 else None)

    def set_mixed_precision(self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False) -> None:
        """A name ("bf16", "fp16", "fp32", "fp8") or dtype gives that dtype for parameters and gradient
        reduction (and, with FSDP1, buffers); outputs stay in the dtype the model computes them in, as in
        Accelerate 1.16. A dict gives the dtypes one by one. Without `override` an existing policy is kept
        (what the Accelerator's mixed_precision does)."""
        dtype = mixed_precision
        if isinstance(mixed_precision, str):
            dtype = PRECISION_DTYPES.get(mixed_precision)
            if dtype is None:
                raise AcceleratorValueError(f"Invalid mixed precision: {mixed_precision}. Must be one of "
                                            f"{list(PRECISION_DTYPES)}")
        elif isinstance(mixed_precision, torch.dtype) and mixed_precision not in PRECISION_DTYPES.values():
            raise AcceleratorValueError(f"Invalid mixed precision: {mixed_precision}. Must be one of "
                                        f"{sorted(set(map(str, PRECISION_DTYPES.values())))}")
        policy_class = MixedPrecisionPolicy if self.fsdp_version == 2 else MixedPrecision
        if override or self.mixed_precision_policy is None:
            dtypes = {"param_dtype": dtype, "reduce_dtype": dtype}
            if self.fsdp_version == 1:
                dtypes["buffer_dtype"] = torch.float32 if buffer_autocast else dtype
            self.mixed_precision_policy = policy_class(**dtypes)
        elif isinstance(self.mixed_precision_policy, dict):
            # The required keys must be there; any other key the policy class takes may be given too.
            keys = ["param_dtype", "reduce_dtype"] + (["buffer_dtype"] if self.fsdp_version == 1 else [])
            given = {key: PRECISION_DTYPES.get(value, value) for key, value in self.mixed_precision_policy.items()}
            if set(keys) - set(given) or any(v not in PRECISION_DTYPES.values() for v in given.values()):
                raise AcceleratorValueError(f"Invalid mixed precision policy: {self.mixed_precision_policy}. Must be "
                                            f"a `dict` with keys {keys}, each a dtype among bf16, fp16, fp32")
            self.mixed_precision_policy = policy_class(**given)

    def validate_mixed_precision_policy(self) -> None:
        required = MixedPrecisionPolicy if self.fsdp_version == 2 else MixedPrecision
        if not isinstance(self.mixed_precision_policy, required):
            raise AcceleratorValueError(f"mixed_precision_policy must be an instance of "
                                        f"`torch.distributed.fsdp.{required.__name__}` (fsdp_version="
                                        f"{self.fsdp_version}), or a name or dict of dtypes")

    def set_cpu_offload(self) -> None:
        if isinstance(self.cpu_offload, bool):
            if self.fsdp_version == 2:
                self.cpu_offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
            else:
                self.cpu_offload = CPUOffload(offload_params=self.cpu_offload)

    def validate_cpu_offload(self) -> None:
        required = OffloadPolicy if self.fsdp_version == 2 else CPUOffload
        if not isinstance(self.cpu_offload, required):
            raise AcceleratorValueError(f"`cpu_offload` must be a bool or a `torch.distributed.fsdp."
                                        f"{required.__name__}` with fsdp_version={self.fsdp_version}, got "
                                        f"{self.cpu_offload!r}")
