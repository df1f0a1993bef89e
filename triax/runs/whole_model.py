"""The whole model a command scores or answers with (`triax eval MODEL`), whichever tool saved it:
a triax run directory (TrainedRun below: its newest good snapshot; a LoRA run's base with the
snapshot's adapters) or a transformers directory (triax/interop/formats.py's open_whole_model),
recognised once, each read through the one interface (triax/interop/foreign_run.py's whole_model)."""

from __future__ import annotations

import os

import torch

from triax import safe_files, safe_yaml
from triax.data.tokenizer import BPETokenizer
from triax.errors import TriaxError
from triax.interop.foreign_run import ForeignRun
from triax.interop.formats import open_whole_model, recognise
from triax.runs.chat_generate import load_chat_model
from triax.config import TrainConfig, from_dict
from triax.runs.reader import check_exists, configured_snapshot_root, load_run_model


class TrainedRun(ForeignRun):
    """A triax run directory as a whole model: its config.yaml read (a damaged one, or one naming a
    snapshot location triax does not read, is one line) before any snapshot; its text codec (the
    run's vocabulary or tokenizer.json) known once the model is read."""

    kind = "run"
    is_triax_run = True

    def __init__(self, path: str):
        config_file = os.path.join(path, "config.yaml")
        self.run_config = TrainConfig()
        if os.path.isfile(config_file):
            configured_snapshot_root(path)  # reports a damaged config.yaml in one line
            self.run_config = from_dict(safe_yaml.loads(safe_files.read_text(config_file), config_file) or {})
        super().__init__(path, {}, None)

    def whole_model(self, device: torch.device) -> torch.nn.Module:
        if self.run_config.model.lora.rank:  # a LoRA run's snapshots hold the adapters: the base is model.init_from
            model = load_chat_model(self.path, self.run_config, device)
            self.codec = BPETokenizer.from_file(os.path.join(self.path, "tokenizer.json"))
            return model
        model, self.codec, _ = load_run_model(self.path, str(device))
        return model


def open_model(path: str, device: torch.device) -> ForeignRun:
    """The run or checkpoint at `path` whose whole model is read on `device` (`whole_model`; its
    `codec` then set): a TrainedRun, or a transformers directory; one line for anything else."""
    check_exists(path, "a triax run directory or a transformers directory")
    if recognise(path, "the checkpoint") == "triax":  # the one order of recognition (interop/formats.py)
        return TrainedRun(path)
    source = open_whole_model(path, BPETokenizer.from_file, device)
    if source is None:
        raise TriaxError(f"{path!r} is neither a triax run directory (model.json) nor a transformers "
                         "directory (config.json); give one of them")
    return source
