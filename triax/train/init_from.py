"""`model.init_from`: start training from existing weights instead of a random initialisation:
a transformers directory of model_type gpt2, llama, qwen2 or mistral (what `save_pretrained`
writes, or a snapshot directory in the Hugging Face cache; nothing is downloaded), another triax
run (its newest good snapshot), nanoGPT's ckpt.pt (or the out_dir holding it:
triax/interop/nanogpt/checkpoint.py), or a Llama in Meta's layout: Meta's folder (params.json,
consolidated.00.pth: triax/interop/meta/folder.py) or torchtitan's DCP checkpoint folder
(triax/interop/torchtitan/checkpoint.py), both read through triax/interop/meta/weights.py.

The checkpoint fixes the architecture (every model.* key but dropout) and the text codec: the
directory's tokenizer.json, a run's tokenizer.json or character vocabulary, which then encodes
`data.task=char` text. Weights are read only where this rank holds them (transformers' safetensors
by lazy slices; a triax snapshot through the layout-independent loader), after the model is built
in its layout and before any step (Meta's weights file memory-mapped, torchtitan's chunks through
DCP, each rank's boxes only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from triax import checkpoint, safe_files
from triax.interop.torchtitan import checkpoint as torchtitan
from triax.interop.meta import folder as meta_folder
from triax.interop.nanogpt import checkpoint as nanogpt
from triax.data.tokenizer import BPETokenizer
from triax.errors import ConfigError
from triax.interop.meta import weights as meta_llama
from triax.interop.hf import directory as hf
from triax.models.config import GPTConfig, architecture_fields
from triax.models.decoder import vocabulary_rows
from triax.interop.hf.files import copy_into
from triax.train.commands import open_run
from triax.train.run_files import KEPT_SOURCE_DIR


@dataclass
class InitSource:
    path: str
    kind: str  # "transformers" | "run" | "nanogpt" | "meta" | "torchtitan"
    architecture: dict  # GPTConfig fields the checkpoint fixes
    codec: object | None  # encodes text for the run: a BPETokenizer or a character Vocabulary
    snapshot: str | None = None
    nanogpt: object | None = None  # the checked ckpt.pt (kind "nanogpt")
    meta_weights: object | None = None  # the checked tensors in Meta's layout (kinds "meta", "torchtitan")
    trainer: object | None = None  # a Trainer's checked checkpoint-N, with trainer.continue_from
    context_reason: str = ""  # why the context is what it is, when not the checkpoint's max positions
    # {name: path} of the transformers files describing the checkpoint besides its weights (config,
    # generation config, tokenizer files), which the run keeps a copy of (keep_description)
    description: dict = field(default_factory=dict)


def resolve(path: str, model=None) -> InitSource:
    """`model`: the run's model.* keys, for what a folder in Meta's layout does not record
    (torchtitan's head counts, rotary settings and norm epsilon; the rope scaling factor of a
    params.json without one)."""
    if nanogpt.is_nanogpt_checkpoint(path) and not os.path.isfile(os.path.join(path, "model.json")):
        # Read whole now (a pickle cannot be read by slices), checked before any process group.
        read = nanogpt.open_checkpoint(path)
        return InitSource(path, "nanogpt", read.architecture(), None, nanogpt=read)
    foreign = not any(os.path.isfile(os.path.join(path, name)) for name in ("model.json", "config.json"))
    if foreign and meta_folder.is_meta_folder(path):
        read = meta_folder.MetaFolder(path, getattr(model, "rope_factor", 8.0))
        return _meta_layout(path, "meta", read, read.fields, os.path.join(path, meta_folder.PARAMS_FILE))
    if foreign and torchtitan.is_dcp_folder(path):
        read = torchtitan.TorchtitanCheckpoint(path)
        run_keys = {key: getattr(model, key) for key in torchtitan.RUN_KEYS} if model is not None else {}
        return _meta_layout(path, "torchtitan", read, read.architecture(run_keys), read.described_by)
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from={path!r} is not a directory; give a transformers directory "
                          "(save_pretrained output or a Hugging Face cache snapshot) or a triax run directory")
    if os.path.isfile(os.path.join(path, "model.json")):
        reader, model_config, vocab = open_run(path)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            vocab.source_path = os.path.join(path, "tokenizer.json")  # the new run keeps a copy
        # A run started from a transformers checkpoint passes on the copies it kept of its files.
        kept = os.path.join(path, KEPT_SOURCE_DIR)
        description = hf.description_files(kept, follow_links=False) if safe_files.is_directory(kept) else {}
        return InitSource(path, "run", architecture_fields(model_config), vocab, reader.snapshot,
                          description=description)

    if not hf.is_hf_directory(path):
        raise ConfigError(f"model.init_from={path!r} has neither model.json (a triax run) nor config.json "
                          "(a transformers checkpoint)")
    architecture = hf.architecture(path)
    # Missing or damaged weights, or weights that are not the config's model, fail here: before any
    # process group, and before the model (of the config's size) is allocated.
    hf.check_weights(path, GPTConfig(**architecture))
    codec = None
    tokenizer = hf.tokenizer_file(path)
    if tokenizer is not None:
        codec = BPETokenizer.from_file(tokenizer)
        codec.source_path = tokenizer
    reason = ""
    if architecture["arch"] != "gpt2" and hf.window_of(path) is not None:
        reason = (f" (its sliding_window: triax attends to the whole context, which equals sliding-window "
                  f"attention only within the window)")
    return InitSource(path, "transformers", architecture, codec, context_reason=reason,
                      description=hf.description_files(path))


def _meta_layout(path: str, kind: str, stored, fields: dict, described_by: str) -> InitSource:
    """A checkpoint in Meta's layout (its folder read as `stored`), checked against the
    architecture `fields` before anything of the model's size is allocated."""
    try:
        config = GPTConfig(**fields)
    except ConfigError as error:
        raise ConfigError(f"model.init_from={path!r} describes a model triax cannot build: {error}") from None
    weights = meta_llama.MetaWeights(stored, config.head_dim)
    meta_llama.check_weights(weights, config, path, described_by)
    codec = None
    tokenizer = hf.tokenizer_file(path)  # Meta's tokenizer.model is not read (triax/interop/meta/folder.py)
    if tokenizer is not None:
        codec = BPETokenizer.from_file(tokenizer)
        codec.source_path = tokenizer
    return InitSource(path, kind, architecture_fields(config), codec, meta_weights=weights)


def keep_description(source: InitSource | None, run_dir: str) -> None:
    """Copy the checkpoint's description files into the run (RUN/init_from/), replacing what an
    earlier start kept; a run without them keeps none. They are read now, with the weights, rather
    than from model.init_from at export time: by then the directory may be gone (a pruned cache
    snapshot) or hold another model (saved over), and the export must describe the checkpoint this
    run actually started from."""
    kept = os.path.join(run_dir, KEPT_SOURCE_DIR)
    description = source.description if source is not None else {}
    # Read before anything is replaced (model.init_from may be this very directory's parent run).
    contents = {name: safe_files.read_bytes(path, hf.MAX_DESCRIPTION_BYTES) for name, path in description.items()}
    if contents:
        safe_files.make_directory(kept)
        for name, data in contents.items():
            safe_files.write_atomic(os.path.join(kept, name), data)
    if safe_files.is_directory(kept):
        for name in set(hf.DESCRIPTION_FILES) - set(contents):
            safe_files.remove_file(os.path.join(kept, name))
        if not contents:
            try:
                os.rmdir(kept)
            except OSError:  # holds something triax did not write: left alone
                pass


def check_fits(source: InitSource, data_vocab_size: int, block_size: int) -> None:
    """The data must fit the checkpoint's vocabulary and context."""
    arch = source.architecture
    if data_vocab_size > arch["vocab_size"]:
        raise ConfigError(f"the data has token ids up to {data_vocab_size - 1} but model.init_from={source.path!r} "
                          f"has a vocabulary of {arch['vocab_size']}; use data tokenized with its tokenizer")
    if block_size > arch["block_size"]:
        raise ConfigError(f"data.block_size={block_size} is longer than model.init_from's context of "
                          f"{arch['block_size']} positions{source.context_reason}; use data.block_size <= "
                          f"{arch['block_size']}")


def load_weights(source: InitSource, model, model_config, stored_name) -> None:
    """Overwrite this rank's part of the freshly built model with the checkpoint's values."""
    if source.kind == "run":
        # By the real rows of the embedding and head: the run may have padded its vocabulary otherwise.
        checkpoint.load_snapshot(source.snapshot, model, None, restore_rng=False, stored_name=stored_name,
                                 real_rows=vocabulary_rows(model_config))
        return
    if source.kind == "nanogpt":
        weights = nanogpt.NanoGPTWeights(source.nanogpt)
        copy_into(model, weights, weights.source_of, model_config.vocab_size, stored_name)
        return
    if source.kind in ("meta", "torchtitan"):
        weights = source.meta_weights
        copy_into(model, weights, weights.source_of, model_config.vocab_size, stored_name)
        return
    hf.load_into(model, source.path, model_config, stored_name)
