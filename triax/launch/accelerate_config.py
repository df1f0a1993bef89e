"""Accelerate's own config files (what `accelerate config` writes) for `triax launch --config_file`.

The file's launch keys become triax's LaunchConfig. Its `fsdp_config:` section becomes the FSDP_*
environment `accelerate launch` gives its workers (with `accelerate launch`'s defaults for the keys
the file leaves out), which the Accelerator's FullyShardedDataParallelPlugin reads, exactly as
Accelerate's reads it. Every other key is either honoured or refused in one line naming it.
"""

from __future__ import annotations

from triax.errors import ConfigError, UsageError
from triax.launch.variables import check_value

# distributed_type -> triax's parallel layout (Accelerate's MULTI_<device> types are data parallel).
LAYOUTS = {"NO": "none", "MULTI_CPU": "ddp", "MULTI_GPU": "ddp", "FSDP": "fsdp"}
REFUSED_TYPES = {
    "DEEPSPEED": "use distributed_type: FSDP (FSDP2 shards like ZeRO-3)",
    "MEGATRON_LM": "use `triax train` with parallel.tp / parallel.pp",
    "XLA": "use CUDA or CPU processes",
}
LAUNCH_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
               "rdzv_backend", "use_cpu", "mixed_precision")
# Keys that change nothing for triax at these values (what `accelerate config` writes by default).
NEUTRAL = {
    "compute_environment": ("LOCAL_MACHINE",), "debug": (False, True), "same_network": (False, True),
    "main_training_function": ("main",), "downcast_bf16": (False, "no"), "enable_cpu_affinity": (False,),
    "tpu_use_cluster": (False,), "tpu_use_sudo": (False,), "tpu_name": (None,), "tpu_zone": (None,),
    "command_file": (None,), "commands": (None, []), "tpu_vm": (None, []),
    "tpu_env": (None, []), "gpu_ids": (None, "all"),  # the questionnaire writes tpu_env: [] for every machine
    "deepspeed_config": ({},), "megatron_lm_config": ({},), "fp8_config": ({},), "parallelism_config": ({},),
    "mpirun_config": ({},), "dynamo_config": ({}, {"dynamo_backend": "NO"}),
}

# `fsdp_config` key -> (FSDP_* variable, `accelerate launch`'s default when the file omits it;
# None: the variable is left unset, as accelerate launch does).
FSDP_ENVIRONMENT = {
    "fsdp_version": ("FSDP_VERSION", "1"),
    "fsdp_sharding_strategy": ("FSDP_SHARDING_STRATEGY", "FULL_SHARD"),
    "fsdp_reshard_after_forward": ("FSDP_RESHARD_AFTER_FORWARD", "true"),
    "fsdp_offload_params": ("FSDP_OFFLOAD_PARAMS", "false"),
    "fsdp_min_num_params": ("FSDP_MIN_NUM_PARAMS", str(10**8)),
    "fsdp_auto_wrap_policy": ("FSDP_AUTO_WRAP_POLICY", None),
    "fsdp_transformer_layer_cls_to_wrap": ("FSDP_TRANSFORMER_CLS_TO_WRAP", None),
    "fsdp_backward_prefetch": ("FSDP_BACKWARD_PREFETCH", None),
    "fsdp_state_dict_type": ("FSDP_STATE_DICT_TYPE", None),
    "fsdp_forward_prefetch": ("FSDP_FORWARD_PREFETCH", "false"),
    "fsdp_use_orig_params": ("FSDP_USE_ORIG_PARAMS", "true"),
    "fsdp_cpu_ram_efficient_loading": ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true"),
    "fsdp_sync_module_states": ("FSDP_SYNC_MODULE_STATES", "true"),
    "fsdp_activation_checkpointing": ("FSDP_ACTIVATION_CHECKPOINTING", "false"),
    "fsdp_activation_checkpointing_offload": ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false"),
    "fsdp_ignored_modules": ("FSDP_IGNORED_MODULES", None),
}
# Written as accelerate launch writes them: lower-cased (True -> "true", "FULL_SHARD" -> "full_shard").
LOWERED = {"fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_forward_prefetch", "fsdp_use_orig_params",
           "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_activation_checkpointing",
           "fsdp_activation_checkpointing_offload"}


def is_accelerate_config(data: dict) -> bool:
    return "distributed_type" in data or "compute_environment" in data


def fsdp_environment(fsdp_config: dict, path: str) -> dict[str, str]:
    """The variables `accelerate launch --use_fsdp` sets for this `fsdp_config` section."""
    if not isinstance(fsdp_config, dict):
        raise ConfigError(f"{path}: fsdp_config should hold key: value pairs, found {fsdp_config!r}")
    # accelerate launch accepts the keys with or without their fsdp_ prefix.
    given = {key if key.startswith("fsdp_") else f"fsdp_{key}": value for key, value in fsdp_config.items()}
    unknown = sorted(set(given) - set(FSDP_ENVIRONMENT))
    if unknown:
        raise ConfigError(f"{path}: fsdp_config has unknown key(s) {', '.join(unknown)}; known keys are "
                          f"{', '.join(FSDP_ENVIRONMENT)}")
    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, (variable, default) in FSDP_ENVIRONMENT.items():
        value = given.get(key, default)
        if value is not None:
            if key in given:  # a value Accelerate could not take fails here, naming the file's key
                check_value(variable, value, f"{path}: fsdp_config.{key}", ConfigError)
            env[variable] = str(value).lower() if key in LOWERED else str(value)
    if env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true" and env["FSDP_SYNC_MODULE_STATES"] != "true":
        raise ConfigError(f"{path}: fsdp_cpu_ram_efficient_loading: true needs fsdp_sync_module_states: true "
                          "(as accelerate launch requires)")
    return env


# `accelerate launch`'s --fsdp_* flags: every fsdp_config key except fsdp_ignored_modules.
FSDP_FLAGS = tuple(key for key in FSDP_ENVIRONMENT if key != "fsdp_ignored_modules")


def fsdp_flags_environment(flags: dict, file_environment: dict[str, str]) -> dict[str, str]:
    """The environment of `--use_fsdp --fsdp_*` flags over a config file's: as in accelerate
    launch, a flag wins over the file's key, and a key neither gives takes launch's default."""
    for key, value in flags.items():
        check_value(FSDP_ENVIRONMENT[key][0], value, f"--{key}", UsageError)
    keys = {variable: key for key, (variable, _) in FSDP_ENVIRONMENT.items()}
    from_file = {keys[name]: value for name, value in file_environment.items() if name in keys}
    return {**file_environment, **fsdp_environment({**from_file, **flags}, "triax launch --use_fsdp")}


def from_accelerate(data: dict, path: str) -> tuple[dict, dict[str, str]]:
    """(LaunchConfig fields, environment for the workers) from an Accelerate config file."""
    kind = str(data.get("distributed_type", "NO")).upper()
    if kind in REFUSED_TYPES:
        raise ConfigError(f"{path}: distributed_type: {kind} is not supported by triax; {REFUSED_TYPES[kind]}")
    if kind not in LAYOUTS and not kind.startswith("MULTI_"):
        raise ConfigError(f"{path}: distributed_type: {kind} is not one triax knows; use NO, MULTI_CPU, "
                          "MULTI_GPU or FSDP")
    fields = {key: data[key] for key in LAUNCH_KEYS if data.get(key) is not None}
    fields["parallel"] = LAYOUTS.get(kind, "ddp")
    if fields.get("mixed_precision") is False:  # an unquoted `no` in YAML
        fields["mixed_precision"] = "no"
    if str(fields.get("mixed_precision", "no")).lower() == "fp8":
        raise ConfigError(f"{path}: mixed_precision: fp8 is not supported by triax; use bf16")
    env = fsdp_environment(data.get("fsdp_config") or {}, path) if kind == "FSDP" else {}
    for key, value in data.items():
        if key in LAUNCH_KEYS or key in ("distributed_type", "fsdp_config"):
            continue
        if key not in NEUTRAL:
            raise ConfigError(f"{path}: {key}: {value!r} is not a key triax launch reads from an Accelerate config; "
                              f"it reads {', '.join(LAUNCH_KEYS + ('distributed_type', 'fsdp_config'))}")
        if value not in NEUTRAL[key]:
            if key == "gpu_ids":  # which GPUs, as accelerate launch restricts them
                env["CUDA_VISIBLE_DEVICES"] = str(value)
                continue
            raise ConfigError(f"{path}: {key}: {value!r} is not supported by triax (only "
                              f"{' or '.join(repr(v) for v in NEUTRAL[key])}); remove the key")
    return fields, env
