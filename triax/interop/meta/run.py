"""A Llama checkpoint in Meta's layout as a run starts from it: Meta's own folder (folder.py) or a
torchtitan DCP step (triax/interop/torchtitan/checkpoint.py), its architecture checked against the
weights' shapes before anything of the model's size is allocated, then read box by box: Meta's
weights file memory-mapped, torchtitan's chunks through DCP, each rank's boxes only."""

from __future__ import annotations

import os

import torch

from triax.errors import ConfigError
from triax.interop.foreign_run import CodecOf, ForeignRun, StoredName, same_name
from triax.interop.hf.files import copy_into, tokenizer_file
from triax.interop.meta import folder as meta_folder
from triax.interop.meta.weights import MetaWeights, check_weights
from triax.interop.torchtitan import checkpoint as torchtitan
from triax.models.config import GPTConfig, architecture_fields


class MetaLayout(ForeignRun):
    """The checked tensors in Meta's layout (`stored`: a MetaFolder or a TorchtitanCheckpoint), of
    the architecture `fields` (fixed by `described_by`, for messages)."""

    def __init__(self, path: str, kind: str, stored: object, fields: dict, described_by: str, codec_of: CodecOf):
        try:
            config = GPTConfig(**fields)
        except ConfigError as error:
            raise ConfigError(f"model.init_from={path!r} describes a model triax cannot build: {error}") from None
        self.weights = MetaWeights(stored, config.head_dim)
        check_weights(self.weights, config, path, described_by)
        tokenizer = tokenizer_file(path)  # Meta's tokenizer.model is not read (triax/interop/meta/folder.py)
        super().__init__(path, architecture_fields(config), codec_of(tokenizer) if tokenizer is not None else None)
        self.kind = kind

    def load_weights(self, model: torch.nn.Module, model_config: GPTConfig,
                     stored_name: StoredName = same_name) -> None:
        copy_into(model, self.weights, self.weights.source_of, model_config.vocab_size, stored_name)


def open_meta_folder(path: str, model: object, codec_of: CodecOf) -> MetaLayout:
    """Meta's folder; `model`: the run's model.* keys, for the rope scaling factor of a params.json
    without one."""
    read = meta_folder.MetaFolder(path, getattr(model, "rope_factor", 8.0))
    return MetaLayout(path, "meta", read, read.fields, os.path.join(path, meta_folder.PARAMS_FILE), codec_of)


def open_torchtitan(path: str, model: object, codec_of: CodecOf) -> MetaLayout:
    """torchtitan's DCP step; `model`: the run's model.* keys, for what the folder does not record
    (its head counts, rotary settings and norm epsilon)."""
    read = torchtitan.TorchtitanCheckpoint(path)
    run_keys = {key: getattr(model, key) for key in torchtitan.RUN_KEYS} if model is not None else {}
    return MetaLayout(path, "torchtitan", read, read.architecture(run_keys), read.described_by, codec_of)
