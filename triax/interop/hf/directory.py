"""Reading a Hugging Face `transformers` checkpoint directory into a triax model, whatever its
family: which family reads it (the registered families' adapters, by model_type), the architecture
it fixes, and this rank's slices of its weights. The files themselves are read by files.py; what
differs per family (config fields, tensor names and layouts) lives in each family's adapter,
triax/models/<family>/hf.py.
`triax export --format hf` is the inverse (triax/interop/hf/export.py). HFDirectory (below) is the
directory as a run starts from it (triax/interop/foreign_run.py's interface): config.json read once,
the safetensors opened once for the check and the load.
"""

from __future__ import annotations

import os
import re
from typing import Callable

import torch

from triax.errors import ConfigError
from triax.models import build_model, parameter_shapes
from triax.models.memory import check_whole_model_fits
from triax.runtime.place import detect_place
from triax.models.config import GPTConfig, architecture_fields
from triax.models.family import FAMILIES
from triax.interop.foreign_run import CodecOf, ForeignRun, StoredName, same_name
from triax.interop.hf import block_fp8
from triax.models.json_kinds import type_error
from triax.interop.hf.files import (DESCRIPTION_FILES, MAX_DESCRIPTION_BYTES, CheckpointError, HFWeights, check_source,
                                   copy_into, description_files, is_hf_directory, read_json, tokenizer_file)

__all__ = ["DESCRIPTION_FILES", "MAX_DESCRIPTION_BYTES", "CheckpointError", "HFWeights", "architecture", "check_weights",
           "description_files", "family_of", "is_hf_directory", "load_into", "read_hf_config", "tokenizer_file",
           "window_of"]



def adapters() -> dict:
    """transformers' model_type -> the Hugging Face adapter of the registered family that reads it."""
    return {model_type: spec.hf for spec in FAMILIES.values() if spec.hf is not None
            for model_type in spec.hf.MODEL_TYPES}


def read_hf_config(directory: str, follow_links: bool = True) -> dict:
    """config.json, of a model_type triax builds, every field triax reads of the JSON type
    transformers gives it (triax/models/json_kinds.py)."""
    path = os.path.join(directory, "config.json")
    config = read_json(directory, "config.json", "give a directory written by save_pretrained", follow_links)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object; not a config "
                              "transformers wrote")
    problem = type_error(config)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    model_type = config.get("model_type")
    known = adapters()
    if model_type not in known:
        classes = [getattr(adapter, "CLASSES", {}).get(name, name) for name, adapter in known.items()]
        raise CheckpointError(f"{path} has model_type {model_type!r}; triax builds {', '.join(known)} "
                              f"(transformers' {', '.join(classes)})")
    return config


def family_of(config: dict):
    """The adapter (a family's hf module) that reads a checkpoint with this config.json."""
    return adapters()[config["model_type"]]


def architecture(directory: str, config: dict | None = None) -> dict:
    """Every GPTConfig field a checkpoint directory fixes (all but dropout, the fine-tuning run's own
    choice, and the layout's vocabulary padding); one line naming any config field triax cannot
    honour or any value out of range. `config`: its config.json, when already read."""
    path = os.path.join(directory, "config.json")
    config = read_hf_config(directory) if config is None else config
    try:
        block_fp8.block_size(config)  # a quantization triax cannot read is refused before any weight is
        return architecture_fields(GPTConfig(**family_of(config).architecture(config)))
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {str(error).removeprefix('config.json: ')}") from None
    except ConfigError as error:
        named = re.search(r"model\.(\w+)", str(error))
        field = family_of(config).CONFIG_NAMES.get(named.group(1)) if named else None
        source = f" (model.{named.group(1)} is config.json's {field})" if field else ""
        raise CheckpointError(f"{path} describes a model triax cannot build: {error}{source}") from None
    except (KeyError, TypeError, ValueError) as error:
        what = f"it lacks {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
        raise CheckpointError(f"{path}: {what}; not a config transformers wrote") from None


def window_of(directory: str, config: dict | None = None) -> int | None:
    """The sliding attention window of a checkpoint's layers, if any (its family's adapter reads it)."""
    config = read_hf_config(directory) if config is None else config
    window = getattr(family_of(config), "sliding_window", None)
    return window(config) if window is not None else None


def check_weights(directory: str, model_config: GPTConfig, config: dict | None = None,
                  weights: HFWeights | None = None) -> None:
    """Every tensor a model of `model_config` reads from `directory` is there, with the shape the
    config gives it and a floating dtype: checked from the safetensors headers alone, before the
    model is allocated, so a config.json describing a model its weights do not hold (a billion
    parameters over kilobytes) is one line, not gigabytes allocated first. `config` and `weights`: its
    config.json and safetensors, when already read."""
    config = read_hf_config(directory) if config is None else config
    weights = _weights(config, directory, model_config, weights)
    source_of = family_of(config).sources(weights, model_config)
    for name, shape in parameter_shapes(model_config).items():
        source, transposed, shift, fused = source_of(name)
        check_source(weights, source, name, shape, transposed, shift, fused, model_config.vocab_size)


def load_into(model: torch.nn.Module, directory: str, model_config: GPTConfig,
              stored_name: Callable[[str], str] = lambda n: n, config: dict | None = None) -> int:
    """copy_into with the family's name mapping: this rank's part of `model` from `directory`."""
    config = read_hf_config(directory) if config is None else config
    weights = _weights(config, directory, model_config)
    source_of = family_of(config).sources(weights, model_config)
    return copy_into(model, weights, source_of, model_config.vocab_size, stored_name)


def _weights(config: dict, directory: str, model_config: GPTConfig, weights: HFWeights | None = None):
    """The directory's tensors as the family reads them (8-bit block-scaled ones dequantized, a
    mixture of experts' stacked per expert); `weights`: the directory's safetensors, when already opened."""
    weights = HFWeights(directory) if weights is None else weights
    block = block_fp8.block_size(config)
    if block is not None:
        weights = block_fp8.BlockScaled(weights, block)
    wrap = getattr(family_of(config), "wrap_weights", None)
    return wrap(weights, model_config) if wrap is not None else weights


class HFDirectory(ForeignRun):
    """A transformers checkpoint directory as a run starts from it (or as a whole model a command
    scores or answers with: `whole_on`): its config.json read once, its weights checked against it
    from the safetensors headers alone (before any process group, and before the model, of the
    config's size, is allocated), then read by this rank's slices."""

    kind = "transformers"

    def __init__(self, path: str, codec_of: CodecOf | None, whole_on: torch.device | None = None):
        """`codec_of`: the text codec of its tokenizer.json (None: none is read); `whole_on`: the
        device a whole copy is built on (whole_model: `triax eval`, `triax generate --chat`'s base),
        where it is checked to fit before the weights are opened; such a copy keeps no description."""
        self.config = read_hf_config(path)
        fields = architecture(path, self.config)
        if whole_on is not None:
            # From the config and the safetensors headers alone, before anything is allocated; every
            # process of this host (torchrun's LOCAL_WORLD_SIZE) loads a whole copy.
            check_whole_model_fits(GPTConfig(**fields), whole_on, os.path.join(path, "config.json"),
                                   detect_place().local_world_size)
        # Missing or damaged weights, or weights that are not the config's model, fail here.
        self.weights = HFWeights(path)
        check_weights(path, GPTConfig(**fields), self.config, self.weights)
        tokenizer = tokenizer_file(path) if codec_of is not None else None
        codec = codec_of(tokenizer) if tokenizer is not None else None
        if whole_on is not None:  # scored or answered with as it is: no run starts from it
            super().__init__(path, fields, codec)
            return
        reason = ""
        if window_of(path, self.config) is not None:
            reason = (" (its sliding_window: triax attends to the whole context, which equals sliding-window "
                      "attention only within the window)")
        super().__init__(path, fields, codec, context_reason=reason, description=description_files(path))

    def whole_model(self, device: torch.device, dropout: float = 0.0) -> torch.nn.Module:
        config = GPTConfig(**self.architecture, dropout=dropout)
        with torch.device("meta"):
            model = build_model(config)
        model.to_empty(device=device)
        if config.tie_embeddings:
            model.lm_head.weight = model.tok_emb.weight
        self.load_weights(model, config)
        return model.eval()

    def load_weights(self, model: torch.nn.Module, model_config: GPTConfig,
                     stored_name: StoredName = same_name) -> None:
        weights = _weights(self.config, self.path, model_config, self.weights)
        source_of = family_of(self.config).sources(weights, model_config)
        copy_into(model, weights, source_of, model_config.vocab_size, stored_name)
