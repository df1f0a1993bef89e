"""LoRA adapters in PEFT's format: a directory with adapter_config.json and adapter_model.safetensors,
what `peft.PeftModel.from_pretrained(base, DIRECTORY)` loads and `save_pretrained` writes.

Tensor names are the transformers name of the adapted layer (its family's hf.hf_name) with
`lora_A.weight` / `lora_B.weight` in place of its `weight`, under PEFT's `base_model.model.` prefix
(llama family: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). `triax export
--format peft` writes such a directory from a run's snapshot; `model.lora.init_from=DIR` reads one
into the adapters of a freshly built model (this rank's slices only).
"""

from __future__ import annotations

import json
import os
import stat

from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save

from triax import safe_files
from triax.arguments import written_by_triax_safetensors
from triax.errors import ConfigError, printable
from triax.models.llama import hf as hf_llama
from triax.models.config import GPTConfig
from triax.models.family import lora_layers, spec_of
from triax.models.init import local_box
from triax.models.lora_config import ADAPTER_MARK, TRIAX_NAMES, LoRAConfig, target_keys

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FACTORS = ("lora_A", "lora_B")


def peft_name(name: str, arch: str | None = None) -> str:
    """PEFT's name of triax adapter parameter `name` (layers.0.attn.q_proj.lora_A.weight) in a
    model.arch=`arch` model (None: the llama block's names)."""
    layer, factor = name.split(ADAPTER_MARK, 1)  # "layers.0.attn.q_proj", "A.weight"
    # The family's own transformers names (DeepSeek-V3's shared experts...); the llama block's by default.
    hf_name = getattr(spec_of(arch).hf, "hf_name", hf_llama.hf_name) if arch is not None else hf_llama.hf_name
    weight = hf_name(f"{layer}.weight")
    return f"{PEFT_PREFIX}{weight.removesuffix('.weight')}.lora_{factor}"


def output_files() -> dict:
    """{file: whether triax wrote the file at a path} of an adapter directory: the config is triax's
    when the weights beside it are (written together, weights first)."""
    def weights(path: str) -> bool:
        return written_by_triax_safetensors(path, "triax_adapter")

    def config(path: str) -> bool:
        return safe_files.is_regular(path) and weights(os.path.join(os.path.dirname(path), WEIGHTS_FILE))

    return {WEIGHTS_FILE: weights, CONFIG_FILE: config}


def peft_modules(lora: LoRAConfig, model_config: GPTConfig | None) -> list[str]:
    """PEFT's target_modules for model.lora.targets on a model of `model_config` (None: a model
    whose family is unknown, whose all-linear names no layer)."""
    available = lora_layers(model_config) if model_config is not None else {}
    return [TRIAX_NAMES[key] for key in target_keys(lora.targets, available)]


def adapter_config(lora: LoRAConfig, base: str | None, model_config: GPTConfig) -> dict:
    """adapter_config.json as PEFT writes it for a causal LM's LoRA adapter."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": peft_modules(lora, model_config),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "use_rslora": False, "use_dora": False, "layers_to_transform": None}


def write_adapter(tensors: dict[str, torch.Tensor], lora: LoRAConfig, base: str | None, out_dir: str,
                  model_config: GPTConfig) -> int:
    """Write {triax adapter name: full tensor} of a model of `model_config` to `out_dir` in PEFT's
    format; returns the tensor count."""
    safe_files.make_directory(out_dir)
    named = {peft_name(name, model_config.arch): tensor.detach().to(torch.float32).contiguous()
             for name, tensor in tensors.items()}
    # triax_adapter marks the file as triax's export, which a later export may replace (PEFT ignores it).
    safe_files.write_atomic(os.path.join(out_dir, WEIGHTS_FILE), save(named, metadata={"format": "pt",
                                                                                      "triax_adapter": "1"}))
    safe_files.write_atomic(os.path.join(out_dir, CONFIG_FILE), json.dumps(adapter_config(lora, base, model_config),
                                                                            indent=2))
    return len(named)


class AdapterError(ConfigError, ValueError):
    """A PEFT adapter directory that cannot be read into this model's adapters."""


def adapter_file(directory: str, name: str) -> str:
    """The path of the adapter directory's file `name`, refused if it links outside the directory
    (the adapter is the directory's own files, nothing elsewhere on the machine)."""
    path = os.path.join(directory, name)
    real, home = os.path.realpath(path), os.path.realpath(directory)
    if not real.startswith(home + os.sep):
        raise AdapterError(f"model.lora.init_from: {path} links outside {directory} (to {printable(real)}); copy the "
                           "adapter's files into one directory")
    return real


def read_adapter_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    try:
        config = safe_files.read_json(adapter_file(directory, CONFIG_FILE))
    except AdapterError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        raise AdapterError(f"model.lora.init_from: cannot read {path} ({type(error).__name__}: "
                           f"{printable(str(error))[:200]}); give a directory PEFT's save_pretrained wrote") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"model.lora.init_from: {path} is not a LoRA adapter's config (peft_type must be LORA)")
    return config


# PEFT settings that change what the adapter computes and that triax does not implement: an
# adapter with any of them set loads into a model that differs from PEFT's, so it is refused.
# (value, meaning): unset is None, empty, false or the value shown.
UNSUPPORTED = {
    "alpha_pattern": "a per-layer lora_alpha", "rank_pattern": "a per-layer rank",
    "layers_to_transform": "adapters on some layers only", "layers_pattern": "adapters on some layers only",
    "modules_to_save": "whole modules trained besides the adapters", "fan_in_fan_out": "transposed weights",
    "lora_bias": "a bias in lora_B", "target_parameters": "adapters on parameters",
    "trainable_token_indices": "trained token embeddings", "exclude_modules": "excluded modules",
}


def check_matches(config: dict, lora: LoRAConfig, directory: str, model_config: GPTConfig | None = None) -> None:
    """The adapter's rank, alpha and layers are this run's model.lora (on a model of `model_config`),
    and nothing in it changes what the adapter computes beyond what triax computes."""
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    wanted = peft_modules(lora, model_config)
    differences = []
    if config.get("r") != lora.rank:
        differences.append(f"r={config.get('r')!r} (model.lora.rank={lora.rank})")
    if not isinstance(config.get("lora_alpha"), (int, float)) or float(config["lora_alpha"]) != float(lora.alpha):
        differences.append(f"lora_alpha={config.get('lora_alpha')!r} (model.lora.alpha={lora.alpha})")
    if not isinstance(targets, list) or sorted(map(str, targets)) != sorted(wanted):
        differences.append(f"target_modules={printable(str(targets))[:100]} (model.lora.targets={wanted})")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            differences.append(f"{key}=true (triax trains plain LoRA)")
    if config.get("bias", "none") not in ("none", None):
        differences.append(f"bias={printable(str(config.get('bias')))[:40]!r} (triax trains no biases: 'none')")
    for key, meaning in UNSUPPORTED.items():
        if config.get(key) not in (None, False, {}, [], ""):
            differences.append(f"{key}={printable(json.dumps(config[key]))[:80]} ({meaning}, which triax does not "
                               "apply)")
    if differences:
        raise AdapterError(f"model.lora.init_from={directory!r} does not match this run: " + ", ".join(differences)
                           + "; set model.lora to the adapter's values, or save the adapter without those settings")


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def model_config_of(model: torch.nn.Module) -> GPTConfig | None:
    """The config of `model` (a Decoder, or a pipeline rank's stages of one); None for another module."""
    for module in model.modules():
        if isinstance(getattr(module, "config", None), GPTConfig):
            return module.config
    return None


def _check_names(names: set[str], expected: set[str], path: str) -> None:
    unused = sorted(name for name in names if name not in expected and name.replace(".default.", ".") not in expected)
    if unused:
        raise AdapterError(f"model.lora.init_from: {path} has {len(unused)} tensors this model has no place for, e.g. "
                           f"{printable(unused[0])[:120]!r}; give an adapter saved for this model")


def check_adapter(model_config: GPTConfig, lora: LoRAConfig) -> None:
    """Check model.lora.init_from against the whole model before anything of the run is written:
    its config, and every tensor's name, shape, dtype and values, on a model of shapes alone."""
    from triax.models import build_model  # deferred: the model classes, when there is an adapter only
    from triax.models.lora import apply_lora

    with torch.device("meta"):
        model = build_model(model_config)
        apply_lora(model, lora)
    load_adapter(model, lora.init_from, lora, whole=True, copy=False)


@torch.no_grad()
def load_adapter(model: torch.nn.Module, directory: str, lora: LoRAConfig,
                 stored_name: Callable[[str], str] = lambda name: name,
                 whole: bool = False, copy: bool = True) -> int:
    """Copy the adapter directory's tensors into this rank's part of `model`'s adapters; every tensor
    of the file checked against the model first (its name, shape, dtype and finite values).
    `whole`: `model` is the whole model (a pipeline rank's holds some blocks only), every tensor of the
    file one of its adapters (check_adapter checks so before a run starts)."""
    model_config = model_config_of(model)
    arch = model_config.arch if model_config is not None else None
    check_matches(read_adapter_config(directory), lora, directory, model_config)
    path = adapter_file(directory, WEIGHTS_FILE)
    shown = os.path.join(directory, WEIGHTS_FILE)
    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except OSError as error:  # named as it is: missing, or unreadable by this user
        raise AdapterError(f"model.lora.init_from: {shown} cannot be read ({error.strerror or error})") from None
    if not regular:
        raise AdapterError(f"model.lora.init_from: {shown} is not a regular file")
    read = 0
    try:
        with safe_open(path, framework="pt") as stored:
            names = set(stored.keys())
            adapters = [(stored_name(name), parameter) for name, parameter in model.named_parameters()
                         if ADAPTER_MARK in stored_name(name)]
            if whole:
                _check_names(names, {peft_name(name, arch) for name, _ in adapters}, shown)
            for name, parameter in adapters:
                read += _load_one(stored, names, name, parameter, shown, arch, copy)
    except AdapterError:
        raise
    except Exception as error:  # safetensors' own errors: a damaged file
        raise AdapterError(f"model.lora.init_from: cannot read {shown} ({type(error).__name__}: "
                           f"{printable(str(error))[:200]})") from None
    return read


def _load_one(stored: object, names: set[str], name: str, parameter: torch.Tensor, path: str, arch: str | None,
              copy: bool = True) -> int:
    source = peft_name(name, arch)
    if source not in names:  # PEFT keeps the adapter name in memory; some tools save it too
        source = source.replace(".weight", ".default.weight")
    if source not in names:
        raise AdapterError(f"model.lora.init_from: {path} has no tensor {peft_name(name, arch)!r} (for {name})")
    local, offset, full_shape = local_box(parameter)
    piece = stored.get_slice(source)
    stored_shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
    if stored_shape != tuple(full_shape):
        raise AdapterError(f"model.lora.init_from: {path}'s {source} has shape {list(stored_shape)}, "
                           f"this model's {name} is {list(full_shape)}")
    if dtype not in FLOAT_DTYPES:
        raise AdapterError(f"model.lora.init_from: {path}'s {source} is {dtype}, not a floating-point tensor; "
                           "give an adapter PEFT saved")
    whole = stored.get_tensor(source)  # an adapter is small (rank x width): checked whole on every rank
    if not bool(torch.isfinite(whole).all()):
        raise AdapterError(f"model.lora.init_from: {path}'s {source} holds NaN or infinite values; give an adapter "
                           "saved before training diverged")
    if local.numel() == 0 or not copy:
        return 0
    box = tuple(slice(start, start + size) for start, size in zip(offset, local.shape))
    local.copy_(whole[box].to(local.dtype))
    return local.numel()
