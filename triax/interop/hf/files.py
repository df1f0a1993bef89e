"""The files of a Hugging Face `transformers` checkpoint directory, whatever its family: the
config, the weights (one safetensors file or a sharded index), the tokenizer, and the copy of
stored tensors into a triax model's (sharded) parameters. triax/interop/hf/directory.py is the front door;
what differs per family lives in its adapter, triax/models/<family>/hf.py.

A checkpoint is a local directory: what `save_pretrained` writes, or a snapshot directory of the
Hugging Face cache (nothing is ever downloaded). Weights are read from safetensors files only
(`pytorch_model.bin` is a pickle, which triax never loads), and lazily: `copy_into` reads, for each
parameter, only the slice this process holds (a tensor-parallel or FSDP shard, a pipeline stage's
layers), so no process ever holds the whole model unless its layout says so.
"""

from __future__ import annotations

import os
import stat
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from triax import safe_files
from triax.errors import printable
from triax.interop.hf import safetensors_header
# The adapters in each family's folder (triax/models/<family>/hf.py) name these too.
from triax.models.checkpoint_source import EXPERT_SLOT, CheckpointError, Source
from triax.models.init import local_box
from triax.models.lora_config import ADAPTER_MARK

MAX_CONFIG_BYTES = 16 * 2**20  # config.json and the shard index are kilobytes; never read a huge one whole



def is_hf_directory(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))


def _roots(directory: str) -> list[str]:
    """Where a link in a checkpoint directory may lead: the directory itself, and for a snapshot of
    the Hugging Face cache (models--org--name/snapshots/REVISION/) its repository's blobs/, where
    each of its files really is."""
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def checkpoint_file(directory: str, name: str, follow_links: bool = True, max_bytes: int | None = None) -> str:
    """The path to read for file `name` of checkpoint `directory`, checked before anything is
    read: a regular file (no FIFO or device, which would block or never end), at most `max_bytes`;
    a link is followed only to a file inside the directory (or, in a Hugging Face cache snapshot,
    to its blobs), never to a file elsewhere, whose bytes would be read, trained on or copied into
    a run and its export. The copies a run keeps (follow_links=False) are files triax wrote: a link
    there is refused. Every refusal, a missing file included, is a CheckpointError."""
    path = os.path.join(directory, name)
    try:
        return _checked(directory, name, path, follow_links, max_bytes)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist" + (" (a link to a missing file)" if os.path.islink(path) else "")
                              + "; the checkpoint is incomplete") from None
    except PermissionError as error:
        raise CheckpointError(f"{path} cannot be read ({error.strerror})") from None


def _checked(directory: str, name: str, path: str, follow_links: bool, max_bytes: int | None) -> str:
    target = path
    if os.path.islink(path):
        target = os.path.realpath(path)
        if not follow_links or not any(target == root or target.startswith(root + os.sep)
                                       for root in _roots(directory)):
            raise CheckpointError(f"{path} is a link to {target}, outside the checkpoint directory; triax reads "
                                  "only the checkpoint's own files (copy the file into the directory)")
    info = os.stat(target) if target != path else os.lstat(path)  # the target is a real path: no link left
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device or directory); "
                              "a checkpoint holds the files transformers wrote")
    if max_bytes is not None and info.st_size > max_bytes:
        raise CheckpointError(f"{path} is {info.st_size} bytes, more than the {max_bytes} a file of its kind "
                              "can hold; it is damaged or not the file transformers wrote")
    return target


def read_json(directory: str, name: str, what: str, follow_links: bool = True):
    """JSON file `name` of a checkpoint directory (see checkpoint_file), one line when it is unsafe or
    damaged; `what` says what to do then."""
    path = checkpoint_file(directory, name, follow_links, MAX_CONFIG_BYTES)
    try:
        return safe_files.read_json(path, MAX_CONFIG_BYTES)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        path = os.path.join(directory, name)
        raise CheckpointError(f"cannot read {path} ({type(error).__name__}: {printable(str(error))[:200]}); "
                              f"{what}") from None


# The files of a checkpoint directory that describe it besides its weights: the config, the
# generation defaults, and every file transformers' tokenizers read. A run started from the
# checkpoint keeps copies of them, so that its `--format hf` export is a drop-in replacement of
# the directory (triax/train/init_from.py keeps them, triax/interop/hf/export.py writes them back).
DESCRIPTION_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                     "chat_template.jinja", "chat_template.json")
# Tokenizers are the largest of them (Llama 3's tokenizer.json is 9 MB); no known one nears this.
MAX_DESCRIPTION_BYTES = 64 * 2**20


def description_files(directory: str, follow_links: bool = True) -> dict[str, str]:
    """{name: path} of the DESCRIPTION_FILES `directory` has; one line for one that is not a small
    regular file of the directory (checkpoint_file). A checkpoint's links inside it (a cache
    snapshot's, to its blobs) are followed; the copies a run keeps (follow_links=False) are files
    triax wrote, never links."""
    found = {}
    for name in DESCRIPTION_FILES:
        if os.path.lexists(os.path.join(directory, name)):
            found[name] = checkpoint_file(directory, name, follow_links, MAX_DESCRIPTION_BYTES)
    return found


def tokenizer_file(directory: str) -> str | None:
    """The directory's tokenizer.json (a cache snapshot's link resolved to its blob), if any."""
    if not os.path.lexists(os.path.join(directory, "tokenizer.json")):
        return None
    return checkpoint_file(directory, "tokenizer.json", max_bytes=MAX_DESCRIPTION_BYTES)


class HFWeights:
    """The safetensors tensors of a checkpoint directory (one file or an index of shards): every
    file's header read and checked (safetensors_header) before the safetensors library opens it,
    every tensor then read lazily, by the slice asked for."""

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.lexists(os.path.join(directory, "model.safetensors")):
            files = {None: "model.safetensors"}
        elif os.path.lexists(index):
            files = _weight_map(directory, index)
        else:
            pickled = any(os.path.isfile(os.path.join(directory, name))
                          for name in ("pytorch_model.bin", "pytorch_model.bin.index.json"))
            raise CheckpointError(f"{directory} has no model.safetensors" + (
                " (only pytorch_model.bin, a pickle, which triax never loads: re-save it with "
                "save_pretrained(..., safe_serialization=True))" if pickled else "; give a save_pretrained directory"))
        self.directory = directory
        self._paths = {}  # file name -> the checked path to open
        self._headers = {}  # file name -> {tensor name: (dtype, shape)}
        self._handles = {}  # file name -> safetensors handle, opened on first read
        for file in dict.fromkeys(files.values()):
            self._paths[file] = checkpoint_file(directory, file)
            try:
                self._headers[file] = safetensors_header.read_header(self._paths[file])
            except (OSError, ValueError) as error:
                raise CheckpointError(f"{os.path.join(directory, file)} is not a readable safetensors file: "
                                      f"{printable(str(error))}") from None
        if None in files:  # one file: every tensor lives there
            self._file_of = dict.fromkeys(self._headers["model.safetensors"], "model.safetensors")
        else:
            self._file_of = {name: file for name, file in files.items()}
            for name, file in files.items():
                if name not in self._headers[file]:
                    raise CheckpointError(f"{index} places tensor {name!r} in {file}, which does not hold it; "
                                          "the index does not belong to these shards")

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

    def entry(self, name: str) -> safetensors_header.TensorEntry:
        """(dtype, shape) of a stored tensor, from its file's checked header."""
        return self._headers[self._file_of[name]][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}")
        file = self._file_of[name]
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(self._paths[file], framework="pt")
            return self._handles[file].get_slice(name)[index]
        except (SafetensorError, OSError, RuntimeError, ValueError) as error:
            # The header was checked: this is a file changed since, or a reading error of the disk.
            first = printable(str(error).splitlines()[0] if str(error) else type(error).__name__)
            raise CheckpointError(f"cannot read tensor {name!r} of {os.path.join(self.directory, file)} "
                                  f"({first}); the file is damaged or was replaced while it was read") from None


def _weight_map(directory: str, index: str) -> dict[str, str]:
    """{tensor name: shard file name} of a sharded checkpoint's index, checked."""
    content = read_json(directory, "model.safetensors.index.json", "the shard index is damaged")
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map mapping tensor names to shard file names; "
                              "not an index transformers wrote")
    for file in set(weight_map.values()):
        if os.path.basename(file) != file or file in ("", ".", ".."):
            raise CheckpointError(f"{index} names {printable(file)!r}; shards are files of the checkpoint "
                                  "directory itself")
    return weight_map


class TensorDict:
    """Tensors in memory by their stored names (a pickled checkpoint's, or its optimizer's moments
    laid out as the parameters), served as HFWeights serves a checkpoint's (`has`, `entry`, `shape`,
    `slice`, `prefix`), so a family's name mapping and copy_tensor place them."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def prefix(self, anchor: str, prefixes: tuple[str, ...]) -> str:
        return next((prefix for prefix in prefixes if prefix + anchor in self.tensors), prefixes[0])

    def has(self, name: str) -> bool:
        return name in self.tensors

    def entry(self, name: str) -> safetensors_header.TensorEntry:
        """(dtype as safetensors names it, shape): what copy_tensor checks against the config before
        it copies (an integer tensor is refused, not converted)."""
        tensor = self.tensors[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        named = safetensors_header.TORCH_DTYPE_NAMES.get(dtype, dtype)
        return safetensors_header.TensorEntry(named, tuple(tensor.shape))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][index]


@torch.no_grad()
def copy_into(model: torch.nn.Module, weights: HFWeights, source_of: Callable[[str], Source], vocab_size: int,
              stored_name: Callable[[str], str] = lambda n: n) -> int:
    """Overwrite every parameter of `model` (plain, DDP-unwrapped, FSDP/TP DTensor shards, a
    pipeline stage) with the checkpoint's values, reading only the slice each holds; `source_of`
    maps a triax parameter name to where its values are stored. Vocabulary padding rows (beyond
    `vocab_size`) are zeroed: they are masked out of the logits. Returns the number of values read."""
    read = 0
    for parameter_name, parameter in model.named_parameters():
        name = stored_name(parameter_name)
        if ADAPTER_MARK in name:  # LoRA adapters are not the checkpoint's (model.lora.init_from loads them)
            continue
        read += copy_tensor(parameter, name, weights, source_of(name), vocab_size)
    for buffer_name, buffer in model.named_buffers():
        # State that is not a parameter but a checkpoint may hold (DeepSeek-V3's correction bias of
        # the router's scores); one the checkpoint lacks keeps its initial value.
        name = stored_name(buffer_name)
        source = source_of(name)
        if weights.has(source.name):
            read += copy_tensor(buffer, name, weights, source, vocab_size)
    return read


def copy_tensor(target: torch.Tensor, name: str, weights: HFWeights, source: Source, vocab_size: int) -> int:
    """Overwrite the part of `target` this rank holds (a tensor laid out as triax's parameter
    `name`: the parameter itself, or its optimizer state) with the stored values; the number read."""
    local, offset, full_shape = local_box(target)
    if local.numel() == 0:
        return 0
    source, transposed, shift, fused = source
    check_source(weights, source, name, full_shape, transposed, shift, fused, vocab_size)
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
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        # A NaN or infinity would train into a model whose every loss is NaN, far from the load.
        if EXPERT_SLOT in source:  # a stack of experts' tensors: name the expert whose tensor it is
            expert = box[0][0] + int((~finite).flatten(1).any(1).nonzero()[0])
            source = source.format(expert=expert)
        raise CheckpointError(f"the checkpoint's {source} holds values that are not finite (NaN or infinity); "
                              "the file is damaged: re-save or re-download it")
    local.copy_(values)
    return values.numel()


def check_source(weights: HFWeights, source: str, name: str, full: tuple, transposed: bool, shift: int,
                 fused: bool, vocab_size: int, described_by: str = "its config.json") -> None:
    """The stored tensor holds what the config says, in a floating dtype (a damaged or mismatched
    checkpoint is one line, not a copy error deep in torch or a silently wrong model)."""
    # A stack of experts' tensors is checked by expert 0's (the stack checks the others against it).
    shown = source.format(expert=0) if EXPERT_SLOT in source else source
    if not weights.has(source):
        raise CheckpointError(f"the checkpoint has no tensor {shown!r} (for triax's {name})")
    stored_dtype, stored = weights.entry(source)
    if stored_dtype not in safetensors_header.FLOAT_DTYPES:
        # An integer tensor would be converted to float silently, its values far from any weight's.
        raise CheckpointError(f"the checkpoint's {shown} is stored as {stored_dtype}, not a floating type "
                              f"({', '.join(safetensors_header.FLOAT_DTYPES)}); triax's {name} is a floating "
                              "parameter: the file is damaged or not a model's weights")
    expected = tuple(reversed(full)) if transposed else tuple(full)
    if name in ("tok_emb.weight", "lm_head.weight"):
        expected = (vocab_size, *expected[1:])  # the rows beyond it are the layout's padding
    if fused:  # the output dimension (the last as stored) also holds the other parameters
        fits = len(stored) == len(expected) and stored[:-1] == expected[:-1] and stored[-1] >= expected[-1] + shift
    else:
        fits = stored == expected
    if not fits:
        raise CheckpointError(f"the checkpoint's {shown} has shape {list(stored)}, but {described_by} makes "
                              f"triax's {name} {list(full)}; the weights do not belong to this config")
