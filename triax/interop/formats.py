"""Which tool saved a path, recognised once: the one way from a path to the ForeignRun
(triax/interop/foreign_run.py) that reads it. A triax run directory (model.json) is not a foreign
format: its own room opens it (triax/runs/reader.py), and `open_foreign` says None."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import torch

from triax.errors import ConfigError, TriaxError, printable
from triax.interop.foreign_run import CodecOf, ForeignRun

from triax.interop.hf.directory import HFDirectory
from triax.interop.hf_trainer.run import TrainerRun, is_trainer_checkpoint
from triax.interop.meta.folder import is_meta_folder
from triax.interop.meta.run import open_meta_folder, open_torchtitan
from triax.interop.nanogpt.checkpoint import is_nanogpt_checkpoint, open_checkpoint
from triax.interop.nanogpt.run import NanoGPTRun
from triax.interop.torchtitan.checkpoint import is_dcp_folder


def _has(path: str, name: str) -> bool:
    # lexists: a link or a FIFO named config.json is still this kind of source, refused (named) by
    # the reader's safe open, not reported as missing.
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, name))


class AmbiguousFormatError(ConfigError, ValueError):
    """A path that two formats claim (a transformers config.json beside nanoGPT's ckpt.pt, ...)."""


class UnreadableSourceError(ConfigError, OSError):
    """A checkpoint path whose directory or files cannot be read (permissions, I/O)."""


# Every format a path may be in, each recognised by names alone (nothing is read), in the one order
# every reader asks them (init_from, continue_from, eval): a path that two claim is refused with
# both named, never read as whichever a reader happened to ask first.
FORMATS = (
    ("triax", "a triax run (model.json)", lambda path: _has(path, "model.json")),
    ("nanogpt", "nanoGPT's ckpt.pt", is_nanogpt_checkpoint),
    ("meta", "Meta's Llama folder (consolidated.NN.pth)", is_meta_folder),
    ("torchtitan", "a torchtitan DCP folder (.metadata or step-N)", is_dcp_folder),
    ("hf", "a transformers checkpoint (config.json)", lambda path: _has(path, "config.json")),
)
# A PEFT adapter beside a checkpoint's weights: not part of the model triax reads (said once per path).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_adapter_warned: set = set()


def recognise(path: str, option: str = "model.init_from") -> str | None:
    """The one format `path` is in (a FORMATS name) or None; one line for a path two formats claim,
    or one whose directory cannot be read. `option`: what the user gave it as, for the line."""
    try:
        found = [(name, what) for name, what, claims in FORMATS if claims(path)]
        adapters = [name for name in ADAPTER_FILES if _has(path, name)]
    except OSError as error:
        raise UnreadableSourceError(f"{option} {path!r} cannot be read ({error.strerror or error}: "
                                    f"{error.filename or path}); give a checkpoint this user can read") from None
    if len(found) > 1:
        raise AmbiguousFormatError(f"{option} {path!r} holds both {found[0][1]} and {found[1][1]}; triax does not "
                                   "guess which model is meant: give a directory holding one (move the other aside)")
    if found and adapters and path not in _adapter_warned:
        _adapter_warned.add(path)
        print(printable(f"triax: warning: {option} {path!r} holds a PEFT adapter ({adapters[0]}) beside "
                        f"{found[0][1]}; triax reads the checkpoint's own weights, not the adapter (merge it into "
                        "the weights first to start from both)"), file=sys.stderr)
    return found[0][0] if found else None


@contextmanager
def readable(path: str, option: str):
    """An OSError while a recognised source is opened (a file or folder this user cannot read) as one
    line; triax's own errors (which are OSErrors too, some of them) pass as they are."""
    try:
        yield
    except TriaxError:
        raise
    except OSError as error:
        raise UnreadableSourceError(f"{option} {path!r}: {error.filename or path} cannot be read "
                                    f"({error.strerror or error}); give a checkpoint this user can read") from None


def open_foreign(path: str, model: object, codec_of: CodecOf, opened: ForeignRun | None = None) -> ForeignRun | None:
    """The checked checkpoint at `path` another tool saved: nanoGPT's ckpt.pt (or the out_dir
    holding it), Meta's Llama folder, a torchtitan DCP step, a transformers Trainer's checkpoint-N
    or a transformers directory; None for anything else (a triax run, a path that is none of these).
    `model`: the run's model.* keys, for what a folder in Meta's layout does not record; `codec_of`:
    the text codec of a tokenizer.json; `opened`: this path's run as `open_continuation` opened it
    for the config's settings (trainer.continue_from), whose files are not read again."""
    kind = recognise(path)
    with readable(path, "model.init_from"):
        if kind == "nanogpt":  # read whole now (a pickle cannot be read by slices), before any process group
            return opened if isinstance(opened, NanoGPTRun) else NanoGPTRun(path, open_checkpoint(path))
        if kind == "meta":
            return open_meta_folder(path, model, codec_of)
        if kind == "torchtitan":
            return open_torchtitan(path, model, codec_of)
        if kind == "hf" and isinstance(opened, TrainerRun):
            return TrainerRun(path, HFDirectory(path, codec_of), opened)
        if kind == "hf":
            return TrainerRun(path, HFDirectory(path, codec_of)) if is_trainer_checkpoint(path) else \
                HFDirectory(path, codec_of)
    return None


def open_continuation(path: str) -> ForeignRun | None:
    """The run at `path` trainer.continue_from can continue, for its settings (`overrides`): a
    transformers Trainer's checkpoint-N or nanoGPT's ckpt.pt; None for anything else."""
    kind = recognise(path, "trainer.continue_from")
    with readable(path, "trainer.continue_from"):
        # A Trainer's checkpoint of a PEFT model holds its adapter, no config.json: still the Trainer's.
        if kind in ("hf", None) and is_trainer_checkpoint(path):
            return TrainerRun(path)
        if kind == "nanogpt":
            return NanoGPTRun(path, open_checkpoint(path))
    return None


def open_whole_model(path: str, codec_of: CodecOf, device: torch.device) -> ForeignRun | None:
    """The checkpoint at `path` a command scores or answers with as a whole model on `device`
    (`triax eval`): a transformers directory (a Trainer's checkpoint-N is one), checked to fit
    `device` before its weights are opened; None for anything else (a triax run: its own
    room opens it, triax/runs/whole_model.py)."""
    kind = recognise(path, "the checkpoint")
    if kind == "hf":
        with readable(path, "the checkpoint"):
            return HFDirectory(path, codec_of, whole_on=device)
    return None
