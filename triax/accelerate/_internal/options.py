"""The Accelerator's constructor arguments, checked and resolved before anything starts.

Accelerate's configuration objects (triax's or Accelerate's own), the plain arguments that
duplicate them, the launch environment (`triax launch`), and the parts of Accelerate that triax
does not provide: each of those fails here, at construction, with the triax alternative named.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from triax.accelerate._internal.errors import AcceleratorValueError, UnsupportedFeatureError
from triax.accelerate._internal.fsdp import default_plugin, read_plugin
from triax.accelerate._internal.fsdp_plugin import FullyShardedDataParallelPlugin
from triax.accelerate.utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    as_config,
    changed_fields,
    split_kwargs_handlers,
)
from triax.launch import settings as launch_settings

# What `triax launch` hands over (names, choices, environment variables) lives in one place.
PRECISION_ALIASES = launch_settings.PRECISION_POLICIES
PARALLEL_CHOICES = launch_settings.PARALLEL_CHOICES

# Accelerate's DDPCommunicationHookType values -> triax's gradient compression names.
COMM_HOOKS = {"no": "none", "fp16": "fp16", "bf16": "bf16", "power_sgd": "powersgd"}

# What triax does not do, and what to use instead (raised at construction).
ALTERNATIVES = {
    "DeepSpeed": "parallel='fsdp' (FSDP2 shards parameters, gradients and optimizer state, like ZeRO-3)",
    "Megatron-LM": "`triax train` with parallel.tp / parallel.pp (tensor and pipeline parallel GPT)",
    "XLA/TPU": "CUDA or CPU devices (triax runs on torch.distributed with NCCL or gloo)",
    "fp8": "mixed_precision='bf16'",
    "ParallelismConfig": "`triax train` layouts (dp_replicate x dp_shard x tp x pp), or parallel='fsdp' here",
    "device maps": "triax.pipe.Pipe (a model split over devices) or parallel='fsdp'",
}


def unsupported(feature: str, how: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(f"{how}: triax does not support {feature}; use {ALTERNATIVES[feature]}")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


@dataclasses.dataclass
class Options:
    mixed_precision: str  # Accelerate's name ("no", "bf16", "fp16") or triax's ("bf16-pure")
    precision_policy: str  # triax's name
    parallel: str
    cpu: bool
    dataloader: DataLoaderConfiguration
    accumulation: GradientAccumulationPlugin
    project: ProjectConfiguration
    ddp_options: dict
    grad_compression: str
    scaler_options: dict
    init_timeout: object  # datetime.timedelta or None
    init_backend: str | None
    scheduler_steps: str  # SCHEDULER_STEPS
    data_order: str  # DATA_ORDERS
    fsdp_plugin: object = None  # the FullyShardedDataParallelPlugin FSDP runs with (parallel='fsdp')
    fsdp: object = None  # what it asks for (triax.accelerate._internal.fsdp.FSDPSettings)
    handlers: dict = dataclasses.field(default_factory=dict)  # kwargs_handlers: {class: the instance given}
    dynamo: object = None  # torch.compile's settings (triax.accelerate._internal.dynamo.resolve_dynamo)


def refuse_unsupported(mixed_precision: str | None, deepspeed_plugin: object | None, megatron_lm_plugin: object | None,
                       parallelism_config: object | None, torch_tp_plugin: object | None,
                       deepspeed_plugins: object | None) -> None:
    if deepspeed_plugin is not None or deepspeed_plugins is not None or _env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise unsupported("DeepSpeed", "Accelerator(deepspeed_plugin=...)")
    if megatron_lm_plugin is not None or _env_flag("ACCELERATE_USE_MEGATRON_LM"):
        raise unsupported("Megatron-LM", "Accelerator(megatron_lm_plugin=...)")
    if torch_tp_plugin is not None:
        raise unsupported("Megatron-LM", "Accelerator(torch_tp_plugin=...)")
    if parallelism_config is not None:
        raise unsupported("ParallelismConfig", "Accelerator(parallelism_config=...)")
    if _env_flag("ACCELERATE_USE_XLA") or os.environ.get("PJRT_DEVICE"):
        raise unsupported("XLA/TPU", "an XLA environment (ACCELERATE_USE_XLA / PJRT_DEVICE)")
    if str(mixed_precision).lower() == "fp8":
        raise unsupported("fp8", "mixed_precision='fp8'")


# triax's preferences, each a named option whose default is Accelerate's behaviour.
SCHEDULER_STEPS = {
    "per_process": "Accelerate's rule: a prepared scheduler steps once per process per optimizer update "
                   "(once when split_batches=True)",
    "per_update": "once per optimizer update, whatever the number of processes",
}
DATA_ORDERS = {
    "loader": "Accelerate's rule: the DataLoader's own sampler and generator give the order, drawn alike "
              "on every process",
    "seeded": "triax's permutation of (seed, epoch) for a shuffled DataLoader: it draws nothing from any "
              "generator, and is the same at any number of processes",
}


def _choice(name: str, value: Any, choices: dict) -> str:
    if value not in choices:
        raise AcceleratorValueError(f"{name}={value!r} is not known; use one of {', '.join(map(repr, choices))}")
    return value


def resolve(*, mixed_precision: str | None, gradient_accumulation_steps: int | None,
            gradient_accumulation_plugin: GradientAccumulationPlugin | None, cpu: bool, parallel: str | None,
            fsdp_plugin: FullyShardedDataParallelPlugin | None, dataloader_config: DataLoaderConfiguration | None,
            split_batches: bool | None, even_batches: bool | None, project_config: ProjectConfiguration | None,
            project_dir: str | None, logging_dir: str | None, kwargs_handlers: list | None,
            scheduler_steps: str = "per_process", data_order: str = "loader", dynamo: object = None) -> Options:
    mixed_precision = resolve_precision(mixed_precision)
    handlers = resolve_handlers(kwargs_handlers)
    parallel = resolve_parallel(parallel, fsdp_plugin)
    fsdp_plugin, fsdp = resolve_fsdp_plugin(parallel, fsdp_plugin)
    return Options(
        mixed_precision=mixed_precision, precision_policy=PRECISION_ALIASES[mixed_precision],
        parallel=parallel, fsdp_plugin=fsdp_plugin, fsdp=fsdp,
        cpu=bool(cpu) or launch_settings.flag_from_environment("use_cpu") or _env_flag("ACCELERATE_USE_CPU"),
        dataloader=resolve_dataloader(dataloader_config, split_batches, even_batches),
        accumulation=resolve_accumulation(gradient_accumulation_steps, gradient_accumulation_plugin),
        project=resolve_project(project_config, project_dir, logging_dir),
        scheduler_steps=_choice("scheduler_steps", scheduler_steps, SCHEDULER_STEPS),
        data_order=_choice("data_order", data_order, DATA_ORDERS), dynamo=dynamo, **handlers)


def resolve_precision(mixed_precision: str | None) -> str:
    mixed_precision = (mixed_precision or launch_settings.from_environment("mixed_precision")
                       or os.environ.get("ACCELERATE_MIXED_PRECISION") or "no")
    mixed_precision = str(getattr(mixed_precision, "value", mixed_precision))
    if mixed_precision not in PRECISION_ALIASES:
        raise AcceleratorValueError(f"mixed_precision={mixed_precision!r} is not supported; use one of "
                                    f"{', '.join(PRECISION_ALIASES)}")
    return mixed_precision


def resolve_accumulation(gradient_accumulation_steps: int | None,
                         gradient_accumulation_plugin: GradientAccumulationPlugin | None) -> GradientAccumulationPlugin:
    accumulation = as_config(gradient_accumulation_plugin, GradientAccumulationPlugin, "gradient_accumulation_plugin")
    if gradient_accumulation_plugin is not None:
        if gradient_accumulation_steps not in (None, 1):
            raise AcceleratorValueError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not "
                                        "both (set the plugin's num_steps)")
        if accumulation.num_steps is None:
            raise AcceleratorValueError("GradientAccumulationPlugin needs num_steps=<int>")
    else:
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = (launch_settings.from_environment("gradient_accumulation_steps")
                                           or os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS") or "1")
        accumulation.num_steps = gradient_accumulation_steps
    try:
        accumulation.num_steps = int(accumulation.num_steps)
    except (TypeError, ValueError):
        raise AcceleratorValueError(f"gradient_accumulation_steps={accumulation.num_steps!r} is not an "
                                    "integer") from None
    if accumulation.num_steps < 1:
        raise AcceleratorValueError(f"gradient_accumulation_steps={accumulation.num_steps} must be 1 or more")
    return accumulation


def resolve_parallel(parallel: str | None, fsdp_plugin: FullyShardedDataParallelPlugin | None) -> str:
    if fsdp_plugin is not None:
        if parallel not in (None, "fsdp"):
            raise AcceleratorValueError(f"fsdp_plugin was given with parallel={parallel!r}; drop one")
        parallel = "fsdp"
    # `accelerate launch` speaks through ACCELERATE_* variables; triax launch's TRIAX_* win.
    parallel = (parallel or launch_settings.from_environment("parallel")
                or ("fsdp" if _env_flag("ACCELERATE_USE_FSDP") else "ddp"))
    if parallel not in PARALLEL_CHOICES:
        raise AcceleratorValueError(f"parallel={parallel!r} is not a layout the Accelerator knows; use one of "
                                    f"{', '.join(PARALLEL_CHOICES)}")
    return parallel


def resolve_fsdp_plugin(parallel: str, fsdp_plugin: FullyShardedDataParallelPlugin | None) -> tuple:
    """(plugin, what it asks for) for parallel='fsdp', else (None, None). The plugin is the one
    given; else, under `accelerate launch --use_fsdp` (or `triax launch` with an Accelerate FSDP
    config), one read from its FSDP_* environment, as Accelerate does; else triax's default."""
    if parallel != "fsdp":
        return None, None
    if fsdp_plugin is not None:
        settings = read_plugin(fsdp_plugin)
        # As Accelerate: transformers' from_pretrained reads it (cpu_ram_efficient_loading).
        os.environ["ACCELERATE_USE_FSDP"] = "true"
        return fsdp_plugin, settings
    if _env_flag("ACCELERATE_USE_FSDP"):
        fsdp_plugin = FullyShardedDataParallelPlugin()
    else:
        fsdp_plugin = default_plugin()
    return fsdp_plugin, read_plugin(fsdp_plugin)


def resolve_dataloader(dataloader_config: DataLoaderConfiguration | None, split_batches: bool | None,
                       even_batches: bool | None) -> DataLoaderConfiguration:
    dataloader = as_config(dataloader_config, DataLoaderConfiguration, "dataloader_config")
    if split_batches is not None:
        dataloader.split_batches = bool(split_batches)
    if even_batches is not None:
        dataloader.even_batches = bool(even_batches)
    return dataloader


def resolve_project(project_config: ProjectConfiguration | None, project_dir: str | None,
                    logging_dir: str | None) -> ProjectConfiguration:
    project = as_config(project_config, ProjectConfiguration, "project_config")
    if project_dir is not None:
        project.set_directories(project_dir)
    if logging_dir is not None:
        project.logging_dir = logging_dir
    if project.total_limit is not None and (not isinstance(project.total_limit, int) or project.total_limit < 1):
        raise AcceleratorValueError(f"ProjectConfiguration(total_limit={project.total_limit!r}) must be a "
                                    "positive integer or None")
    if project.automatic_checkpoint_naming and project.project_dir is None:
        raise AcceleratorValueError("ProjectConfiguration(automatic_checkpoint_naming=True) needs project_dir")
    return project


def resolve_handlers(kwargs_handlers: list | None) -> dict:
    """kwargs_handlers -> the Options fields they set (DDP options and compression, scaler
    options, process-group timeout and backend); autocast options and init_method are refused."""
    handlers = split_kwargs_handlers(kwargs_handlers)
    ddp_options = changed_fields(handlers.get(DistributedDataParallelKwargs), DistributedDataParallelKwargs)
    hook = str(ddp_options.pop("comm_hook", "no"))
    wrapper = str(ddp_options.pop("comm_wrapper", "no"))
    ddp_options.pop("comm_state_option", None)
    if hook not in COMM_HOOKS or wrapper != "no":
        raise UnsupportedFeatureError(f"DistributedDataParallelKwargs(comm_hook={hook!r}, comm_wrapper={wrapper!r}) "
                                      f"is not supported; use comm_hook in {sorted(COMM_HOOKS)} without a wrapper")
    if "bucket_cap_mb" in ddp_options:
        ddp_options["bucket_cap_mb"] = float(ddp_options["bucket_cap_mb"])
    init = changed_fields(handlers.get(InitProcessGroupKwargs), InitProcessGroupKwargs)
    if init.get("init_method"):
        raise UnsupportedFeatureError(f"InitProcessGroupKwargs(init_method={init['init_method']!r}) is not "
                                      "supported; triax rendezvouses through MASTER_ADDR/MASTER_PORT "
                                      "(set by torchrun or `triax launch`)")
    autocast = changed_fields(handlers.get(AutocastKwargs), AutocastKwargs)
    if autocast:
        raise UnsupportedFeatureError(f"AutocastKwargs({autocast}) is not supported; use "
                                      "accelerator.autocast() or mixed_precision='no'")
    return dict(handlers=handlers, ddp_options=ddp_options, grad_compression=COMM_HOOKS[hook],
                scaler_options=changed_fields(handlers.get(GradScalerKwargs), GradScalerKwargs),
                init_timeout=init.get("timeout"), init_backend=init.get("backend"))
