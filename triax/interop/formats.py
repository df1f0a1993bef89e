"""Which tool saved a path, recognised once: the one way from a path to the ForeignRun
(triax/interop/foreign_run.py) that reads it. A triax run directory (model.json) is not a foreign
format: the training room opens it (triax/train/init_from.py), and `open_foreign` says None."""

from __future__ import annotations

import os

from triax.interop.foreign_run import CodecOf, ForeignRun
import torch

from triax.interop.hf.directory import HFDirectory
from triax.interop.hf.files import is_hf_directory
from triax.interop.hf_trainer.run import TrainerRun, is_trainer_checkpoint
from triax.interop.meta.folder import is_meta_folder
from triax.interop.meta.run import open_meta_folder, open_torchtitan
from triax.interop.nanogpt.checkpoint import is_nanogpt_checkpoint, open_checkpoint
from triax.interop.nanogpt.run import NanoGPTRun
from triax.interop.torchtitan.checkpoint import is_dcp_folder


def _has(path: str, name: str) -> bool:
    return os.path.isfile(os.path.join(path, name))


def open_foreign(path: str, model: object, codec_of: CodecOf) -> ForeignRun | None:
    """The checked checkpoint at `path` another tool saved: nanoGPT's ckpt.pt (or the out_dir
    holding it), Meta's Llama folder, a torchtitan DCP step, a transformers Trainer's checkpoint-N
    or a transformers directory; None for anything else (a triax run, a path that is none of these).
    `model`: the run's model.* keys, for what a folder in Meta's layout does not record; `codec_of`:
    the text codec of a tokenizer.json."""
    if is_nanogpt_checkpoint(path) and not _has(path, "model.json"):
        # Read whole now (a pickle cannot be read by slices), checked before any process group.
        return NanoGPTRun(path, open_checkpoint(path))
    foreign = not (_has(path, "model.json") or _has(path, "config.json"))
    if foreign and is_meta_folder(path):
        return open_meta_folder(path, model, codec_of)
    if foreign and is_dcp_folder(path):
        return open_torchtitan(path, model, codec_of)
    if not os.path.isdir(path) or _has(path, "model.json") or not _has(path, "config.json"):
        return None
    if is_trainer_checkpoint(path):
        return TrainerRun(path, HFDirectory(path, codec_of))
    return HFDirectory(path, codec_of)


def open_continuation(path: str) -> ForeignRun | None:
    """The run at `path` trainer.continue_from can continue, for its settings (`overrides`): a
    transformers Trainer's checkpoint-N or nanoGPT's ckpt.pt; None for anything else."""
    if is_trainer_checkpoint(path):
        return TrainerRun(path)
    if is_nanogpt_checkpoint(path):
        return NanoGPTRun(path, open_checkpoint(path))
    return None


def open_whole_model(path: str, codec_of: CodecOf, device: torch.device) -> ForeignRun | None:
    """The checkpoint at `path` a command scores or answers with as a whole model on `device`
    (`triax eval`): a transformers directory (a Trainer's checkpoint-N is one), checked to fit
    `device` before its weights are opened; None for anything else (a triax run: the training
    room opens it, triax/train/run_model.py)."""
    if os.path.isdir(path) and is_hf_directory(path):
        return HFDirectory(path, codec_of, whole_on=device)
    return None
