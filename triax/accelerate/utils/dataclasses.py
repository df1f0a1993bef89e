"""Accelerate's configuration objects, under the same names, fields and defaults.

`from triax.accelerate.utils import DataLoaderConfiguration, ...` replaces Accelerate's import line
for line. The Accelerator also accepts Accelerate's own instances: `as_config` copies the fields
this module knows from any object that has them (duck typing), so a script that keeps
`from accelerate.utils import DataLoaderConfiguration` works unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import Any

from triax.accelerate._internal.errors import AcceleratorTypeError, AcceleratorValueError


class _StrEnum(str, enum.Enum):
    """Accelerate's BaseEnum enums: members are their string values, printed as those values.
    (DistributedType, ComputeEnvironment and SageMakerDistributedType are plain `str, Enum` in
    Accelerate: printed, and in f-strings, as `DistributedType.MULTI_CPU`; so are triax's.)"""

    def __str__(self) -> str:
        return self.value


class DistributedType(str, enum.Enum):
    """How the processes are set up. A str enum, as in Accelerate: members equal their names
    (`DistributedType.MULTI_CPU == "MULTI_CPU"`) and serialise to JSON as strings. Every member of
    Accelerate's enum is here, in its order, so scripts that compare against any of them run; triax
    itself only ever reports NO, MULTI_CPU, MULTI_GPU and FSDP."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class PrecisionType(_StrEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class LoggerType(_StrEnum):
    """Accelerate's tracker names; triax has tensorboard, wandb and mlflow of these (and its own "jsonl")."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class RNGType(_StrEnum):
    """The random generators Accelerator(rng_types=...) can keep in step (triax's devices use torch,
    cuda and generator; the others are Accelerate's other accelerators)."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DDPCommunicationHookType(_StrEnum):
    """DistributedDataParallelKwargs(comm_hook=...): fp16, bf16 and power_sgd are triax's gradient
    compression; batched_power_sgd is refused when the model is prepared."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class DynamoBackend(_StrEnum):
    """torch.compile's backends by Accelerate's names (triax compiles only when the script calls
    torch.compile itself: Accelerator(dynamo_backend=...) is refused)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class ComputeEnvironment(str, enum.Enum):
    """Where an `accelerate config` file says the job runs (triax runs on the local machine)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, enum.Enum):
    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class KwargsHandler:
    """The base of the kwargs handlers. `to_kwargs()`: the fields whose value differs from the
    class default (Accelerate's rule: only what the user changed is passed on, so triax's own
    defaults hold otherwise)."""

    def to_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def to_kwargs(self) -> dict:
        default = type(self)().to_dict()
        return {name: value for name, value in self.to_dict().items() if default[name] != value}


@dataclasses.dataclass
class DataLoaderConfiguration(KwargsHandler):
    """As Accelerate's (triax.accelerate.data_loader follows its rules draw for draw):
    split_batches: a dataloader's batch_size is the global batch, cut into one piece per process.
    dispatch_batches: process 0 reads every batch and sends each process its part (default: for
    an IterableDataset when batches are placed on the device).
    even_batches: repeat samples from the start of the pass so every process gets as many batches;
    gather_for_metrics drops the repeats.
    use_seedable_sampler: a shuffled DataLoader's order becomes a function of (seed, epoch)
    (SeedableRandomSampler); call the loader's set_epoch(epoch) each epoch.
    data_seed: that order's seed (default: torch's initial seed).
    non_blocking: host-to-device copies of batches do not wait (with pin_memory).
    use_stateful_dataloader: prepared loaders are torchdata StatefulDataLoaders, whose position
    save_state keeps and load_state restores.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """num_steps: micro-steps per optimizer update inside `accumulate`.
    adjust_scheduler: accepted (a prepared scheduler always steps once per real update).
    sync_with_dataloader: also synchronise (and step) on the last batch of a dataloader.
    sync_each_batch: synchronise gradients on every micro-step (saves memory, costs bandwidth).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class ProjectConfiguration(KwargsHandler):
    """project_dir: where save_state writes without a directory (`<project_dir>/checkpoints`).
    logging_dir: where trackers write (default: project_dir).
    automatic_checkpoint_naming: save_state() writes `<project_dir>/checkpoints/checkpoint_<iteration>`.
    total_limit: with automatic naming, keep at most this many checkpoints (oldest deleted first).
    iteration: the number the next automatically named checkpoint gets.
    save_on_each_node: accepted; snapshots are written once, on the shared directory.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self):
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Options of torch's DistributedDataParallel for prepared models (only changed ones are passed).
    comm_hook: "no", "fp16", "bf16" or "power_sgd" (triax's gradient compression)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: str = "no"
    comm_wrapper: str = "no"
    comm_state_option: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Options of torch.amp.GradScaler for mixed_precision='fp16'."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Options for creating the process group: backend and timeout (a datetime.timedelta)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    enabled: bool = True
    cache_enabled: bool | None = None


# Accelerate's kwargs handlers that exist only for features triax does not provide.
UNSUPPORTED_HANDLERS = {
    "FP8RecipeKwargs": "fp8 training", "AORecipeKwargs": "fp8 training", "TERecipeKwargs": "fp8 training",
    "MSAMPRecipeKwargs": "fp8 training", "ProfileKwargs": "the profiler handler",
    "DeepSpeedPlugin": "DeepSpeed", "MegatronLMPlugin": "Megatron-LM",
    "TorchDynamoPlugin": "the TorchDynamo plugin", "TorchTensorParallelPlugin": "the tensor-parallel plugin",
}

KWARGS_HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs)


def as_config(value: Any, cls: type, argument: str):
    """`value` as an instance of triax's `cls`: itself, a copy of a duck-typed object with the same
    fields (Accelerate's own class), or a dict of fields. None gives the defaults."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    names = [field.name for field in dataclasses.fields(cls)]
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise AcceleratorValueError(f"{argument} got unknown field(s) {unknown}; {cls.__name__} has "
                                        f"{', '.join(names)}")
        return cls(**value)
    present = [name for name in names if hasattr(value, name)]
    if not present or type(value).__name__ != cls.__name__:
        raise AcceleratorTypeError(f"{argument} must be a {cls.__name__} (triax's or Accelerate's), "
                                   f"got a {type(value).__name__}")
    fields = {name: getattr(value, name) for name in present}
    for name in ("comm_hook", "comm_wrapper"):  # Accelerate's enums -> their string values
        if name in fields and isinstance(fields[name], enum.Enum):
            fields[name] = fields[name].value
    return cls(**fields)


def split_kwargs_handlers(handlers: Any) -> dict:
    """Accelerator(kwargs_handlers=[...]) -> {class: instance}, each kind at most once."""
    found = {}
    for handler in handlers or []:
        name = type(handler).__name__
        if name in UNSUPPORTED_HANDLERS:
            from triax.accelerate._internal.errors import UnsupportedFeatureError

            raise UnsupportedFeatureError(f"kwargs_handlers got a {name}: triax does not support "
                                          f"{UNSUPPORTED_HANDLERS[name]}; see the README's Accelerate table")
        matches = [cls for cls in KWARGS_HANDLERS if isinstance(handler, cls) or cls.__name__ == name]
        if not matches:
            raise AcceleratorTypeError(f"kwargs_handlers got a {name}; triax knows "
                                       f"{', '.join(cls.__name__ for cls in KWARGS_HANDLERS)}")
        cls = matches[0]
        if cls in found:
            raise AcceleratorValueError(f"kwargs_handlers got two {cls.__name__}; pass each kind once")
        found[cls] = handler
    return found


def changed_fields(handler: Any, cls: type) -> dict:
    """The fields of a handler (triax's or Accelerate's) that differ from `cls`'s defaults."""
    if handler is None:
        return {}
    if isinstance(handler, cls):
        return handler.to_kwargs()
    if hasattr(handler, "to_kwargs"):  # Accelerate's own rule, applied to its own defaults
        changed = dict(handler.to_kwargs())
    else:
        changed = as_config(handler, cls, cls.__name__).to_kwargs()
    return {name: (value.value if isinstance(value, enum.Enum) else value) for name, value in changed.items()}
