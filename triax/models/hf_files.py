"""The files of a Hugging Face `transformers` checkpoint directory, whatever its family: the
config, the weights (one safetensors file or a sharded index), the tokenizer, and the copy of
stored tensors into a triax model's (sharded) parameters. triax/models/hf.py is the front door;
what differs per family lives in hf_gpt2.py and hf_llama.py.

A checkpoint is a local directory: what `save_pretrained` writes, or a snapshot directory of the
Hugging Face cache (nothing is ever downloaded). Weights are read from safetensors files only
(`pytorch_model.bin` is a pickle, which triax never loads), and lazily: `copy_into` reads, for each
parameter, only the slice this process holds (a tensor-parallel or FSDP shard, a pipeline stage's
layers), so no process ever holds the whole model unless its layout says so.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
from safetensors import safe_open

from triax import safe_files
from triax.errors import ConfigError
from triax.models.init import local_box
from triax.models.lora import ADAPTER_MARK

MAX_CONFIG_BYTES = 16 * 2**20  # config.json and the shard index are kilobytes; never read a huge one whole


class CheckpointError(ConfigError, ValueError):
    """A model.init_from checkpoint that is missing, of an architecture triax does not build, or not
    readable safely."""


def is_hf_directory(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))


def read_json(path: str, what: str):
    try:
        # A Hugging Face cache snapshot links each file to its blob: the link is followed here (the
        # directory is an input, never written), the target must still be a small regular file.
        return safe_files.read_json(os.path.realpath(path), MAX_CONFIG_BYTES)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        raise CheckpointError(f"cannot read {path} ({type(error).__name__}: {error}); {what}") from None


# The files of a checkpoint directory that describe it besides its weights: the config, the
# generation defaults, and every file transformers' tokenizers read. A run started from the
# checkpoint keeps copies of them, so that its `--format hf` export is a drop-in replacement of
# the directory (triax/train/init_from.py keeps them, triax/train/hf_export.py writes them back).
DESCRIPTION_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                     "chat_template.jinja", "chat_template.json")
# Tokenizers are the largest of them (Llama 3's tokenizer.json is 9 MB); no known one nears this.
MAX_DESCRIPTION_BYTES = 64 * 2**20


def description_files(directory: str, follow_links: bool = True) -> dict[str, str]:
    """{name: path} of the DESCRIPTION_FILES `directory` has; one line for one that is not a small
    regular file. A checkpoint's links (a cache snapshot's, to its blobs) are followed; the copies
    a run keeps (follow_links=False) are files triax wrote, never links."""
    found = {}
    for name in DESCRIPTION_FILES:
        path = os.path.join(directory, name)
        if not os.path.lexists(path):
            continue
        if follow_links:
            path = os.path.realpath(path)
        if not safe_files.is_regular(path) or os.path.getsize(path) > MAX_DESCRIPTION_BYTES:
            raise CheckpointError(f"{os.path.join(directory, name)} is not a regular file of at most "
                                  f"{MAX_DESCRIPTION_BYTES} bytes; not a file transformers wrote")
        found[name] = path
    return found


def tokenizer_file(directory: str) -> str | None:
    """The directory's tokenizer.json (a cache snapshot's link resolved to its blob), if any."""
    path = os.path.join(directory, "tokenizer.json")
    return os.path.realpath(path) if os.path.isfile(path) else None


class HFWeights:
    """The safetensors tensors of a checkpoint directory, opened lazily (one file or an index of shards)."""

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.isfile(single):
            files = {None: single}
        elif os.path.isfile(index):
            weight_map = read_json(index, "the shard index is damaged").get("weight_map", {})
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map is not a mapping of tensor names to file names")
            files = {}
            for name, file in weight_map.items():
                if os.path.basename(file) != file or file in ("", ".", ".."):
                    raise CheckpointError(f"{index} names {file!r}; shards are files of the checkpoint directory itself")
                files[name] = os.path.join(directory, file)
        else:
            pickled = any(os.path.isfile(os.path.join(directory, name))
                          for name in ("pytorch_model.bin", "pytorch_model.bin.index.json"))
            raise CheckpointError(f"{directory} has no model.safetensors" + (
                " (only pytorch_model.bin, a pickle, which triax never loads: re-save it with "
                "save_pretrained(..., safe_serialization=True))" if pickled else "; give a save_pretrained directory"))
        self._handles = {}
        self._file_of = {}
        for name, path in files.items():
            if path not in self._handles:
                try:
                    self._handles[path] = safe_open(path, framework="pt")
                except (OSError, ValueError, RuntimeError) as error:
                    raise CheckpointError(f"{path} is not a readable safetensors file ({error})") from None
            if name is not None:
                self._file_of[name] = path
        if not self._file_of:  # one file: every key lives there
            handle_path = next(iter(self._handles))
            self._file_of = dict.fromkeys(self._handles[handle_path].keys(), handle_path)

    def prefix(self, anchor: str, prefixes: tuple[str, ...]) -> str:
        """Which of `prefixes` the tensor names carry ("transformer.", "model.", or none when saved
        from the base model), found by the tensor `anchor` every checkpoint of the family has."""
        for prefix in prefixes:
            if prefix + anchor in self._file_of:
                return prefix
        raise CheckpointError(f"the safetensors weights have no {anchor} (under any of the prefixes "
                              f"{', '.join(repr(p) for p in prefixes)}); not a checkpoint of this config's model_type")

    def has(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}")
        return self._handles[self._file_of[name]].get_slice(name)[index]


class Source(NamedTuple):
    """Where a triax parameter's values are stored in a checkpoint."""

    name: str
    transposed: bool = False  # stored (in, out), as GPT-2's Conv1D
    offset: int = 0  # where ours start along the stored output dimension (a slice of a fused tensor)
    fused: bool = False  # the stored tensor holds other parameters too (GPT-2's c_attn: q, k and v)


@torch.no_grad()
def copy_into(model: torch.nn.Module, weights: HFWeights, source_of: Callable[[str], Source], vocab_size: int,
              stored_name=lambda n: n) -> int:
    """Overwrite every parameter of `model` (plain, DDP-unwrapped, FSDP/TP DTensor shards, a
    pipeline stage) with the checkpoint's values, reading only the slice each holds; `source_of`
    maps a triax parameter name to where its values are stored. Vocabulary padding rows (beyond
    `vocab_size`) are zeroed: they are masked out of the logits. Returns the number of values read."""
    read = 0
    for parameter_name, parameter in model.named_parameters():
        name = stored_name(parameter_name)
        if ADAPTER_MARK in name:  # LoRA adapters are not the checkpoint's (model.lora.init_from loads them)
            continue
        local, offset, full_shape = local_box(parameter)
        if local.numel() == 0:
            continue
        source, transposed, shift, fused = source_of(name)
        _check_shape(weights, source, name, full_shape, transposed, shift, fused, vocab_size)
        box = [(start, start + size) for start, size in zip(offset, local.shape)]
        values = torch.zeros_like(local)
        if name in ("tok_emb.weight", "lm_head.weight"):
            rows = (box[0][0], min(box[0][1], vocab_size))  # padding rows stay zero
            if rows[1] > rows[0]:
                values[: rows[1] - rows[0]] = weights.slice(source, (slice(*rows), slice(*box[1]))).to(local.dtype)
        elif local.dim() == 2 and transposed:
            # Stored (in, out) (GPT-2's Conv1D): our rows are its columns (past any fused q/k/v before ours)
            part = weights.slice(source, (slice(*box[1]), slice(box[0][0] + shift, box[0][1] + shift)))
            values.copy_(part.t())
        elif local.dim() == 1 and shift:
            values.copy_(weights.slice(source, (slice(box[0][0] + shift, box[0][1] + shift),)))
        else:
            values.copy_(weights.slice(source, tuple(slice(*b) for b in box)))
        local.copy_(values)
        read += values.numel()
    return read


def _check_shape(weights: HFWeights, source: str, name: str, full: tuple, transposed: bool, shift: int,
                 fused: bool, vocab_size: int) -> None:
    """The stored tensor holds what the config says (a damaged or mismatched checkpoint is one line,
    not a copy error deep in torch)."""
    if not weights.has(source):
        raise CheckpointError(f"the checkpoint has no tensor {source!r} (for triax's {name})")
    stored = weights.shape(source)
    expected = tuple(reversed(full)) if transposed else tuple(full)
    if name in ("tok_emb.weight", "lm_head.weight"):
        expected = (vocab_size, *expected[1:])  # the rows beyond it are the layout's padding
    if fused:  # the output dimension (the last as stored) also holds the other parameters
        fits = len(stored) == len(expected) and stored[:-1] == expected[:-1] and stored[-1] >= expected[-1] + shift
    else:
        fits = stored == expected
    if not fits:
        raise CheckpointError(f"the checkpoint's {source} has shape {list(stored)}, but its config.json makes "
                              f"triax's {name} {list(full)}; the weights do not belong to this config")
