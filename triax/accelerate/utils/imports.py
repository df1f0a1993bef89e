"""Accelerate's is_<thing>_available probes, under its names (re-exported by triax.accelerate.utils).

A package counts as available when it can be imported and is installed as a distribution (a
folder that merely shadows the name does not count), at the version the probe asks for. Device
probes ask torch. Nothing here imports the packages it asks about.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import torch
import torch.distributed as dist
from packaging.version import Version

from triax.accelerate.utils.environment import parse_flag_from_env

# is_<key>_available: (import name, distribution names to look for, oldest version, first version that is too new).
_PACKAGES = {
    "aim": ("aim", ("aim",), None, "4.0.0"),
    "amdsmi": ("amdsmi", ("amdsmi",), None, None),
    "boto3": ("boto3", ("boto3",), None, None),
    "bnb": ("bitsandbytes", ("bitsandbytes",), None, None),
    "4bit_bnb": ("bitsandbytes", ("bitsandbytes",), "0.39.0", None),
    "8bit_bnb": ("bitsandbytes", ("bitsandbytes",), "0.37.2", None),
    "clearml": ("clearml", ("clearml",), None, None),
    "comet_ml": ("comet_ml", ("comet_ml",), None, None),
    "datasets": ("datasets", ("datasets",), None, None),
    "deepspeed": ("deepspeed", ("deepspeed",), None, None),
    "dvclive": ("dvclive", ("dvclive",), None, None),
    "import_timer": ("import_timer", ("import_timer",), None, None),
    "lomo": ("lomo_optim", ("lomo_optim",), None, None),
    "matplotlib": ("matplotlib", ("matplotlib",), None, None),
    "mlflow": ("mlflow", ("mlflow", "mlflow-skinny"), None, None),
    "pandas": ("pandas", ("pandas",), None, None),
    "peft": ("peft", ("peft",), None, None),
    "pynvml": ("pynvml", ("pynvml", "nvidia-ml-py"), None, None),
    "pytest": ("pytest", ("pytest",), None, None),
    "sagemaker": ("sagemaker", ("sagemaker",), None, None),
    "schedulefree": ("schedulefree", ("schedulefree",), None, None),
    "swanlab": ("swanlab", ("swanlab",), None, None),
    "timm": ("timm", ("timm",), None, None),
    "torchao": ("torchao", ("torchao",), "0.6.1", None),
    "torchdata": ("torchdata", ("torchdata",), None, None),
    "torchdata_stateful_dataloader": ("torchdata", ("torchdata",), "0.8.0", None),
    "torchvision": ("torchvision", ("torchvision",), None, None),
    "trackio": ("trackio", ("trackio",), None, None),
    "transformer_engine": ("transformer_engine", ("transformer-engine",), None, None),
    "transformers": ("transformers", ("transformers",), None, None),
    "triton": ("triton", ("triton",), None, None),
    "wandb": ("wandb", ("wandb",), None, None),
}

# Accelerators torch reaches through a torch.<name> module of their own (installed by their plugins).
_DEVICE_MODULES = ("mlu", "musa", "npu", "sdaa", "hpu", "xpu", "neuron")


def package_available(key: str) -> bool:
    """Whether is_<key>_available holds: importable, installed, and at an accepted version."""
    module, distributions, oldest, too_new = _PACKAGES[key]
    if importlib.util.find_spec(module) is None:
        return False
    for distribution in distributions:
        try:
            version = Version(importlib.metadata.version(distribution))
        except importlib.metadata.PackageNotFoundError:
            continue
        return (oldest is None or version >= Version(oldest)) and (too_new is None or version < Version(too_new))
    return False


def _device_module_available(name: str) -> bool:
    module = getattr(torch, name, None)
    return module is not None and callable(getattr(module, "is_available", None)) and bool(module.is_available())


def _package_probe(key: str):
    def probe() -> bool:
        return package_available(key)

    probe.__name__ = probe.__qualname__ = f"is_{key}_available"
    module, _, oldest, too_new = _PACKAGES[key]
    probe.__doc__ = f"Whether {module} is installed" + (" at a version Accelerate takes." if oldest or too_new else ".")
    return probe


def _device_probe(name: str):
    def probe(check_device: bool = False) -> bool:
        return _device_module_available(name)

    probe.__name__ = probe.__qualname__ = f"is_{name}_available"
    probe.__doc__ = f"Whether torch reaches {name.upper()} devices here."
    return probe


globals().update({f"is_{key}_available": _package_probe(key) for key in _PACKAGES
                  if key not in ("transformer_engine", "trackio")})
globals().update({f"is_{name}_available": _device_probe(name) for name in _DEVICE_MODULES})


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_rocm_available() -> bool:
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    return torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """triax runs no XLA devices; this says only whether torch_xla is installed (never a TPU or GPU)."""
    if check_is_tpu or check_is_gpu:
        return False
    return importlib.util.find_spec("torch_xla") is not None


def is_hpu_available(init_hccl: bool = False) -> bool:
    return _device_module_available("hpu")


def is_habana_gaudi1() -> bool:
    """A first-generation Gaudi is an HPU without fp16; triax runs on no HPU, so never."""
    return False


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if _device_module_available("xpu"):
        return torch.xpu.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    return not is_habana_gaudi1()


def is_transformer_engine_available() -> bool:
    return package_available("transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """triax does no fp8 training, so never (see is_fp8_available)."""
    return False


def is_fp8_available() -> bool:
    """Whether an fp8 library is installed (Transformer Engine, torchao; Accelerate 1.16 dropped MS-AMP); triax
    itself trains in bf16."""
    return package_available("transformer_engine") or package_available("torchao")


def is_trackio_available() -> bool:
    return sys.version_info >= (3, 10) and package_available("trackio")


def is_tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None or importlib.util.find_spec("tensorboardX") is not None


def is_rich_available() -> bool:
    """rich is installed and ACCELERATE_ENABLE_RICH says to use it."""
    return importlib.util.find_spec("rich") is not None and parse_flag_from_env("ACCELERATE_ENABLE_RICH", False)


def is_bitsandbytes_multi_backend_available() -> bool:
    return False  # triax loads no quantized models


def is_megatron_lm_available() -> bool:
    return False  # triax does not drive Megatron-LM


def is_xccl_available() -> bool:
    probe = getattr(dist.distributed_c10d, "is_xccl_available", None)
    return callable(probe) and probe()


# The collective backend of each device type (Accelerate's TORCH_DISTRIBUTED_BACKENDS, for what torch reaches).
_DISTRIBUTED_BACKENDS = {"cuda": "nccl", "mlu": "cncl", "sdaa": "tccl", "musa": "mccl", "npu": "hccl",
                         "hpu": "hccl", "xpu": "xccl", "neuron": "neuron"}
# Device types whose own torch.<type> module answers memory and availability questions (the others go
# through torch.accelerator).
_NATIVE_DEVICE_MODULES = ("cuda", "mps") + _DEVICE_MODULES


def get_torch_accelerator_backend(check_available: bool = True):
    """(device type, its torch module) of this machine's accelerator, or (None, None) on a CPU-only machine.
    check_available=False names the backend torch was built for without asking whether a device is there."""
    try:
        device = torch.accelerator.current_accelerator()
    except RuntimeError:  # older torch raises on CPU-only builds where newer returns None
        device = None
    if device is not None and (not check_available or torch.accelerator.is_available()):
        if device.type in _NATIVE_DEVICE_MODULES:
            return device.type, torch.get_device_module(device.type)
        return device.type, torch.accelerator
    return None, None


def get_distributed_backend(device_type: str | None) -> str | None:
    """The collective backend for a device type ('nccl' for 'cuda'), or None where torch has none for it."""
    if device_type == "xpu" and not is_xccl_available():
        return None
    return _DISTRIBUTED_BACKENDS.get(device_type)


PROBES = sorted(name for name in globals() if name.startswith("is_") and name.endswith("_available")) + [
    "is_habana_gaudi1"]
