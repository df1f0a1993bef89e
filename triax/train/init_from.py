"""`model.init_from`: start training from existing weights instead of a random initialisation:
a transformers directory of model_type gpt2, llama, qwen2 or mistral (what `save_pretrained`
writes, or a snapshot directory in the Hugging Face cache; nothing is downloaded), another triax
run (its newest good snapshot: TriaxRun below), nanoGPT's ckpt.pt (or the out_dir holding it:
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

from triax import checkpoint, safe_files
from triax.data.tokenizer import BPETokenizer
from triax.errors import ConfigError
from triax.interop.foreign_run import ForeignRun, StoredName, same_name
from triax.interop.formats import open_foreign
from triax.interop.hf.files import DESCRIPTION_FILES, MAX_DESCRIPTION_BYTES, description_files
from triax.models.config import GPTConfig, architecture_fields
from triax.models.decoder import vocabulary_rows
from triax.interop.hf.files import copy_into
from triax.train.runs import open_run
from triax.train.run_files import KEPT_SOURCE_DIR


class TriaxRun(ForeignRun):
    """Another triax run as a run starts from it: its newest good snapshot, read through the
    layout-independent loader, and its text codec (tokenizer.json or character vocabulary)."""

    kind = "run"
    is_triax_run = True

    def __init__(self, path: str):
        reader, model_config, vocab = open_run(path)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            vocab.source_path = os.path.join(path, "tokenizer.json")  # the new run keeps a copy
        # A run started from a transformers checkpoint passes on the copies it kept of its files.
        kept = os.path.join(path, KEPT_SOURCE_DIR)
        description = description_files(kept, follow_links=False) if safe_files.is_directory(kept) else {}
        super().__init__(path, architecture_fields(model_config), vocab, description=description)
        self.snapshot = reader.snapshot

    def load_weights(self, model: torch.nn.Module, model_config: GPTConfig,
                     stored_name: StoredName = same_name) -> None:
        # By the real rows of the embedding and head: the run may have padded its vocabulary otherwise.
        checkpoint.load_snapshot(self.snapshot, model, None, restore_rng=False, stored_name=stored_name,
                                 real_rows=vocabulary_rows(model_config))


def tokenizer_codec(path: str) -> BPETokenizer:
    """The codec of a checkpoint's tokenizer.json, which the new run keeps a copy of."""
    codec = BPETokenizer.from_file(path)
    codec.source_path = path
    return codec


def resolve(path: str, model: object = None) -> ForeignRun:
    """The checked checkpoint at `path`, whichever tool saved it (triax/interop/formats.py), or a
    triax run. `model`: the run's model.* keys, for what a folder in Meta's layout does not record
    (torchtitan's head counts, rotary settings and norm epsilon; the rope scaling factor of a
    params.json without one)."""
    source = open_foreign(path, model, tokenizer_codec)
    if source is not None:
        return source
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from={path!r} is not a directory; give a transformers directory "
                          "(save_pretrained output or a Hugging Face cache snapshot) or a triax run directory")
    if os.path.isfile(os.path.join(path, "model.json")):
        return TriaxRun(path)
    raise ConfigError(f"model.init_from={path!r} has neither model.json (a triax run) nor config.json "
                      "(a transformers checkpoint)")


def keep_description(source: ForeignRun | None, run_dir: str) -> None:
    """Copy the checkpoint's description files into the run (RUN/init_from/), replacing what an
    earlier start kept; a run without them keeps none. They are read now, with the weights, rather
    than from model.init_from at export time: by then the directory may be gone (a pruned cache
    snapshot) or hold another model (saved over), and the export must describe the checkpoint this
    run actually started from."""
    kept = os.path.join(run_dir, KEPT_SOURCE_DIR)
    description = source.description if source is not None else {}
    # Read before anything is replaced (model.init_from may be this very directory's parent run).
    contents = {name: safe_files.read_bytes(path, MAX_DESCRIPTION_BYTES) for name, path in description.items()}
    if contents:
        safe_files.make_directory(kept)
        for name, data in contents.items():
            safe_files.write_atomic(os.path.join(kept, name), data)
    if safe_files.is_directory(kept):
        for name in set(DESCRIPTION_FILES) - set(contents):
            safe_files.remove_file(os.path.join(kept, name))
        if not contents:
            try:
                os.rmdir(kept)
            except OSError:  # holds something triax did not write: left alone
                pass


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
