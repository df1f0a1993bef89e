"""`model.init_from`: start training from existing weights instead of a random initialisation:
a transformers directory of model_type gpt2, llama, qwen2 or mistral (what `save_pretrained`
writes, or a snapshot directory in the Hugging Face cache; nothing is downloaded), another triax
run (its newest good snapshot: triax/interop/triax_run.py), nanoGPT's ckpt.pt (or the out_dir holding it:
triax/interop/nanogpt/checkpoint.py), or a Llama in Meta's layout: Meta's folder (params.json,
consolidated.00.pth: triax/interop/meta/folder.py) or torchtitan's DCP checkpoint folder
(triax/interop/torchtitan/checkpoint.py), both read through triax/interop/meta/weights.py.
Every foreign format is recognised once (triax/interop/formats.py) and read through one
interface (triax/interop/foreign_run.py).

The checkpoint fixes the architecture (every model.* key but dropout) and the text codec: the
directory's tokenizer.json, a run's tokenizer.json or character vocabulary, which then encodes
`data.task=char` text. Weights are read only where this rank holds them (transformers' safetensors
by lazy slices; a triax snapshot through the layout-independent loader), after the model is built
in its layout and before any step (Meta's weights file memory-mapped, torchtitan's chunks through
DCP, each rank's boxes only).
"""

from __future__ import annotations

import os

import torch

from triax.data.tokenizer import BPETokenizer
from triax.errors import ConfigError
from triax.interop.foreign_run import ForeignRun, StoredName
from triax.interop.formats import open_foreign
from triax.models.config import GPTConfig
from triax.runs.reader import as_foreign_run


def tokenizer_codec(path: str) -> BPETokenizer:
    """The codec of a checkpoint's tokenizer.json, which the new run keeps a copy of."""
    codec = BPETokenizer.from_file(path)
    codec.source_path = path
    return codec


def resolve(path: str, model: object = None, opened: ForeignRun | None = None) -> ForeignRun:
    """The checked checkpoint at `path`, whichever tool saved it (triax/interop/formats.py), or a
    triax run. `model`: the run's model.* keys, for what a folder in Meta's layout does not record
    (torchtitan's head counts, rotary settings and norm epsilon; the rope scaling factor of a
    params.json without one); `opened`: trainer.continue_from's run as the config's composition
    opened it (not read again)."""
    source = open_foreign(path, model, tokenizer_codec, opened)
    if source is not None:
        return source
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from={path!r} is not a directory; give a transformers directory "
                          "(save_pretrained output or a Hugging Face cache snapshot) or a triax run directory")
    if os.path.isfile(os.path.join(path, "model.json")):
        return as_foreign_run(path)
    raise ConfigError(f"model.init_from={path!r} has neither model.json (a triax run) nor config.json "
                      "(a transformers checkpoint)")


def check_fits(source: ForeignRun, data_vocab_size: int, block_size: int) -> None:
    """The data must fit the checkpoint's vocabulary and context."""
    arch = source.architecture
    if data_vocab_size > arch["vocab_size"]:
        raise ConfigError(f"the data has token ids up to {data_vocab_size - 1} but model.init_from={source.path!r} "
                          f"has a vocabulary of {arch['vocab_size']}; use data tokenized with its tokenizer")
    if block_size > arch["block_size"]:
        raise ConfigError(f"data.block_size={block_size} is longer than model.init_from's context of "
                          f"{arch['block_size']} positions{source.context_reason}; use data.block_size <= "
                          f"{arch['block_size']}")


def load_weights(source: ForeignRun, model: torch.nn.Module, model_config: GPTConfig,
                 stored_name: StoredName) -> None:
    """Overwrite this rank's part of the freshly built model with the checkpoint's values."""
    source.load_weights(model, model_config, stored_name)
