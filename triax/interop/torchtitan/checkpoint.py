"""torchtitan's Llama checkpoints: a torch.distributed.checkpoint (DCP) folder (`.metadata` and
`__<rank>_<n>.distcp` files), one per saved step in torchtitan's `checkpoint/step-N/`, its model's
tensors in Meta's layout (triax/interop/meta/weights.py: names, rotary order), flattened at the top
or under `model.`, beside the optimizer's, the scheduler's and the data loader's state.

The folder says the shapes, not the head counts (a width of 4096 is 32 heads of 128 or 64 of 64):
a `params.json` beside it (Meta's file) gives them, or the run does (model.n_kv_head; model.n_head
follows from the shapes, which fix how many query heads share one key/value head). Settings the
tensors do not show (model.rope_theta, model.norm_eps, model.rope_scaling) are the run's keys.

`.metadata` is a pickle, which DCP's FileSystemReader unpickles with no restriction. triax reads
it with an unpickler that knows only the names DCP's metadata is made of (its dataclasses, torch
sizes, dtypes and layouts: pickle's documented way of restricting globals; torch's weights-only
unpickler does not read the protocol DCP writes), checks every entry (sizes, chunks, and byte
ranges of files inside the folder), and gives DCP that metadata instead of letting it read the file
again. Tensors are then read by DCP itself, each rank only the saved chunks its own slices overlap,
with torch's weights-only loader.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.serialization
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from triax import safe_files
from triax.interop.meta import weights as meta_llama
from triax.models.config import MAX_SIZES
from triax.interop.hf.files import CheckpointError, checkpoint_file, read_json

METADATA_FILE = ".metadata"
STEP_FOLDER = re.compile(r"step-(\d+)")
# A model's metadata is a few hundred bytes per tensor chunk; a 405B model with its optimizer
# sharded over thousands of ranks stays far below this.
MAX_METADATA_BYTES = 512 * 2**20
MODEL_PREFIXES = ("model.", "")
MAX_DIMENSIONS = 8
# The run's model.* keys that say what a folder without params.json does not record: the
# key/value heads, and what no shape shows.
RUN_KEYS = ("n_kv_head", "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
            "rope_high_freq_factor", "rope_original_context")

# The only globals DCP's metadata pickle names (torch.distributed.checkpoint.metadata and the
# file storage's per-chunk record), and what they build.
_DCP_NAMES = {("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
_DCP_NAMES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_DCP_NAMES[("torch", "Size")] = torch.Size
_DCP_NAMES[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_DCP_NAMES[("pathlib", "PosixPath")] = pathlib.PosixPath  # StorageMeta's checkpoint_id
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) in _DCP_NAMES:
            return _DCP_NAMES[(module, name)]
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def is_dcp_folder(path: str) -> bool:
    """A DCP folder, or torchtitan's checkpoint folder of step-N ones."""
    return os.path.isdir(path) and (os.path.lexists(os.path.join(path, METADATA_FILE)) or latest_step(path) is not None)


def latest_step(path: str) -> str | None:
    """The newest step-N folder of torchtitan's checkpoint folder (what its resume loads). DCP
    writes .metadata last, once every rank's files are written: a folder without it is a save
    that did not finish, and is passed over."""
    steps = [(int(found.group(1)), name) for name in os.listdir(path)
             if (found := STEP_FOLDER.fullmatch(name)) and os.path.lexists(os.path.join(path, name, METADATA_FILE))]
    if not steps:
        return None
    newest = os.path.join(path, max(steps)[1])
    if os.path.islink(newest):  # its files would be read from wherever it leads
        raise CheckpointError(f"{newest} is a link to {os.path.realpath(newest)}; triax reads a checkpoint folder's own "
                              "step folders only (give model.init_from the step folder itself)")
    return newest


def read_metadata(folder: str) -> dcp_metadata.Metadata:
    """The folder's checked DCP metadata (see the module's docstring)."""
    path = checkpoint_file(folder, METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(safe_files.read_bytes(path, MAX_METADATA_BYTES))).load()
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        if found:
            raise CheckpointError(f"{path} needs {found.group(1)} to be unpickled, which triax never runs (a DCP "
                                  "metadata file names DCP's own classes only); the file is not DCP's") from None
        raise CheckpointError(f"{path} is not a readable DCP metadata file ({str(error)[:120]})") from None
    except (OSError, ValueError, EOFError, TypeError, AttributeError, IndexError, KeyError, MemoryError,
            RecursionError) as error:
        raise CheckpointError(f"{path} is not a readable DCP metadata file ({type(error).__name__}: "
                              f"{str(error)[:120]})") from None
    _check_metadata(metadata, folder, path)
    return metadata


def _check_metadata(metadata: dcp_metadata.Metadata, folder: str, path: str) -> None:
    bad = lambda what: CheckpointError(f"{path}: {what}; the file is damaged or not DCP's")  # noqa: E731
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise bad("it holds no DCP Metadata with tensors and storage records")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"a key {key!r:.60} is not a name")
        if isinstance(entry, dcp_metadata.BytesStorageMetadata):
            continue
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata) or not _is_size(entry.size) \
                or not isinstance(getattr(entry.properties, "dtype", None), torch.dtype) \
                or not isinstance(entry.chunks, list):
            raise bad(f"{key} is not a tensor record")
        for chunk in entry.chunks:
            if not (isinstance(chunk, dcp_metadata.ChunkStorageMetadata) and _is_size(chunk.offsets)
                    and _is_size(chunk.sizes) and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                    and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))):
                raise bad(f"{key} has a chunk outside its size {list(entry.size)}")
            if dcp_metadata.MetadataIndex(key, chunk.offsets) not in metadata.storage_data:
                raise bad(f"{key}'s chunk at {list(chunk.offsets)} has no storage record")
        # DCP's chunks of a tensor do not overlap: together they hold every value once. Chunks that
        # hold fewer would leave part of a weight unread (a read also checks that its box is whole).
        if sum(math.prod(chunk.sizes) for chunk in entry.chunks) != math.prod(entry.size):
            raise bad(f"{key}'s chunks do not hold its {math.prod(entry.size)} values")
    sizes = {}
    for index, record in metadata.storage_data.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(record, _StorageInfo):
            raise bad("a storage record is not DCP's")
        name = record.relative_path
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise bad(f"{index.fqn} is stored in {name!r:.80}, not a file of the folder itself")
        if getattr(record, "transform_descriptors", None):
            raise CheckpointError(f"{path}: {index.fqn} is stored transformed ({record.transform_descriptors!r:.60}); "
                                  "triax reads uncompressed DCP files only")
        if name not in sizes:  # a regular file of the folder (no link out, no FIFO)
            sizes[name] = os.stat(checkpoint_file(folder, name)).st_size
        if not (isinstance(record.offset, int) and isinstance(record.length, int) and record.offset >= 0
                and record.length >= 0 and record.offset + record.length <= sizes[name]):
            raise bad(f"{index.fqn}'s bytes {record.offset!r:.20}+{record.length!r:.20} are not within {name} "
                      f"({sizes[name]} bytes)")


def _is_size(value: object) -> bool:
    return isinstance(value, torch.Size) and len(value) <= MAX_DIMENSIONS and all(
        isinstance(n, int) and 0 <= n < 2**40 for n in value)


class CheckedReader(FileSystemReader):
    """DCP's file reader, given the checked metadata instead of unpickling the file again."""

    def __init__(self, folder: str, metadata: dcp_metadata.Metadata):
        super().__init__(folder)
        self._checked = metadata

    def read_metadata(self, *args: object, **kwargs: object):
        return self._checked


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Reads one box (`offsets`, the target's size) of one saved tensor into the target."""

    def __init__(self, key: str, offsets: tuple[int, ...]):
        super().__init__()
        self.key, self.offsets = key, offsets

    def create_local_plan(self) -> LoadPlan:
        target = self.state_dict[self.key]
        chunk = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=target.size())
        items = create_read_items_for_chunk_list(self.key, self.metadata.state_dict_metadata[self.key], [chunk])
        if sum(math.prod(item.lengths) for item in items) != target.numel():
            raise CheckpointError(f"the saved chunks of {self.key} do not cover the box {list(self.offsets)} + "
                                  f"{list(target.shape)}; the checkpoint is damaged")
        return LoadPlan(items)

    def lookup_tensor(self, index: object):
        # The target is the box itself (DCP's own lookup expects a box at offset 0 of a plain tensor).
        return self.state_dict[index.fqn]


class TorchtitanCheckpoint:
    """A checked DCP folder of a Llama in Meta's layout: `entries()` and `read(name, box)` by Meta's
    names, for meta_llama.MetaWeights."""

    def __init__(self, path: str):
        self.path = path
        self.folder = path if os.path.lexists(os.path.join(path, METADATA_FILE)) else latest_step(path)
        self.metadata = read_metadata(self.folder)
        tensors = {key: entry for key, entry in self.metadata.state_dict_metadata.items()
                   if isinstance(entry, dcp_metadata.TensorStorageMetadata)}
        self.prefix = next((prefix for prefix in MODEL_PREFIXES if prefix + "tok_embeddings.weight" in tensors), None)
        if self.prefix is None:
            raise CheckpointError(f"{self.folder} holds no tok_embeddings.weight (at the top or under 'model.'); "
                                  "not a torchtitan Llama checkpoint")
        self._entries = {}
        for key, entry in tensors.items():
            name = key[len(self.prefix):] if key.startswith(self.prefix) else None
            if name is None or (self.prefix == "" and not _is_model_name(name)):
                continue  # the optimizer's, the scheduler's...
            self._entries[name] = (entry.properties.dtype, tuple(entry.size))
        self._reader = None
        self.described_by = ""  # what fixed the architecture (for messages): set by architecture()

    def entries(self) -> dict:
        return {name: entry for name, entry in self._entries.items() if name not in meta_llama.NOT_WEIGHTS}

    def read(self, name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        dtype, _ = self._entries[name]
        target = torch.empty([stop - start for start, stop in box], dtype=dtype)
        key = self.prefix + name
        if self._reader is None:
            self._reader = CheckedReader(self.folder, self.metadata)
        # no_dist: each rank reads its own boxes, with no collective (ranks of a pipeline hold
        # different layers, so they ask for different tensors, in different numbers).
        try:
            with warnings.catch_warnings():  # DCP's note that no_dist loads "in a single process": meant here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({key: target}, storage_reader=self._reader,
                         planner=_BoxLoadPlanner(key, tuple(start for start, _ in box)), no_dist=True)
        except CheckpointError:
            raise
        except (CheckpointException, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as error:
            if isinstance(error, CheckpointException) and error.failures:  # DCP wraps each rank's failure
                error = next(iter(error.failures.values()))[0]
            if isinstance(error, CheckpointError):
                raise error from None
            first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise CheckpointError(f"cannot read {key} from {self.folder} ({first[:200]}); the file is damaged or "
                                  "changed while it was read") from None
        return target

    def architecture(self, run_keys: dict) -> dict:
        """GPTConfig fields: from a params.json beside the folder, else from the tensors' shapes
        and the run's keys (RUN_KEYS; model.n_kv_head is required)."""
        for where in (self.folder, self.path):
            if os.path.lexists(os.path.join(where, "params.json")):
                params = read_json(where, "params.json", "give Meta's params.json or remove it")
                self.described_by = os.path.join(where, "params.json")
                fields = meta_llama.architecture_from_params(params, self.described_by,
                                                             self._entries["tok_embeddings.weight"][1][0],
                                                             run_keys.get("rope_factor", 8.0))
                return {**fields, "tie_embeddings": "output.weight" not in self._entries}
        self.described_by = f"the shapes of {self.folder}'s layer 0"
        shapes = {name: shape for name, (_, shape) in self._entries.items()}
        layers = {int(found.group(1)) for name in shapes if (found := re.match(r"layers\.(\d+)\.", name))}
        embedding = shapes["tok_embeddings.weight"]
        if len(embedding) != 2 or "layers.0.attention.wk.weight" not in shapes \
                or "layers.0.feed_forward.w1.weight" not in shapes:
            raise CheckpointError(f"{self.folder}: the model lacks layers.0's attention.wk or feed_forward.w1, or its "
                                  "embedding is not a matrix; not a torchtitan Llama")
        vocab, dim = embedding
        if layers != set(range(len(layers))):
            raise CheckpointError(f"{self.folder}: the model's layers are numbered {sorted(layers)[:8]}..., not 0 "
                                  "upwards; not a torchtitan Llama (a pipeline stage's folder alone?)")
        key_rows = shapes["layers.0.attention.wk.weight"][0]
        n_kv_head = run_keys.get("n_kv_head")
        if n_kv_head is None:
            raise CheckpointError(f"model.init_from={self.path!r}: a DCP folder records shapes, not head counts; give "
                                  "model.arch=llama model.n_kv_head=N (N: the key/value heads of the model's flavor; "
                                  "model.n_head follows from the shapes), or put the model's params.json beside it")
        if not isinstance(n_kv_head, int) or n_kv_head <= 0 or key_rows % n_kv_head or dim * n_kv_head % key_rows:
            raise CheckpointError(f"model.n_kv_head={n_kv_head} does not fit {self.folder}: its wk has {key_rows} rows "
                                  f"for a width of {dim}; give the model's own number of key/value heads")
        heads = dim * n_kv_head // key_rows
        return {"arch": "llama", "vocab_size": vocab, "block_size": MAX_SIZES["block_size"],
                "n_layer": len(layers), "n_head": heads, "n_embd": dim, "n_kv_head": n_kv_head,
                "head_dim": dim // heads, "intermediate_size": shapes["layers.0.feed_forward.w1.weight"][0],
                "bias": False, "tie_embeddings": "output.weight" not in shapes,
                **{key: value for key, value in run_keys.items() if key != "n_kv_head"}}


def _is_model_name(name: str) -> bool:
    return name.startswith("layers.") or name in ("tok_embeddings.weight", "norm.weight", "output.weight",
                                                   *meta_llama.NOT_WEIGHTS)

