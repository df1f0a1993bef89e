"""The one way triax reads a snapshot: everything it reads is validated first.

Trust flows from the manifest: its schema is checked, then every other file is checked against
the size and sha256 the manifest gives it before it is parsed (JSON) or used (tensor bytes, chunk
by chunk). Names must be the ones triax writes; locally only regular files inside real
directories are read (no symlinks out of the run directory, no FIFO that blocks the reader).
Whatever is wrong — a truncation, a flipped bit, JSON of the wrong shape or types, sizes that do
not add up — becomes SnapshotCorruptError, so the caller falls back to the previous snapshot.
"""

from __future__ import annotations

import hashlib
import json
import math
import re

import torch

from triax.checkpoint.errors import SnapshotCorruptError
from triax.checkpoint.numbers import bad_number, finite_float, reject_constant
from triax.checkpoint.shard_format import DTYPES, SHARDS_METADATA, tensor_from_bytes
from triax.checkpoint.storage import Store

FORMAT = "triax-snapshot/2"
MANIFEST = "manifest.json"
STATE = "state.json"
SNAPSHOT_NAME = re.compile(r"^step_(\d{8})$")
FILE_NAME = re.compile(r"^(state\.json|shards\.json|rng/rank_\d{5}\.json|shards/rank_\d{5}\.bin)$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists a few files per rank: far below this
MAX_JSON_BYTES = 256 << 20  # any JSON file of a snapshot
MAX_DIMS = 8


def is_int(value: object) -> bool:
    return type(value) is int


def is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _require(condition: bool, snapshot: str, what: str) -> None:
    if not condition:
        raise SnapshotCorruptError(f"snapshot {snapshot} is corrupt: {what}")


def parse_json(data: bytes, snapshot: str, relative: str):
    try:
        # NaN, Infinity and 1e999 are refused while parsing: no file of a snapshot holds one.
        return json.loads(data, parse_constant=reject_constant, parse_float=finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise SnapshotCorruptError(f"snapshot {snapshot}: {relative} is not valid JSON "
                                   f"({type(error).__name__})") from None


def _tiles(boxes: list, size: list) -> bool:
    """Whether non-empty chunk boxes (whose volumes already sum to the tensor's) overlap nowhere,
    in O(n log n): the boxes must form a grid, the product of one partition of each dimension (how
    sharding by dimensions cuts a tensor). A grid's cells are disjoint by construction; anything
    else is refused (no layout triax writes produces it)."""
    boxes = [(tuple(o), tuple(s)) for o, s in boxes if all(s)]
    if len(boxes) <= 1:
        return True
    cells = 1
    for dim, total in enumerate(size):
        spans = sorted({(offsets[dim], sizes[dim]) for offsets, sizes in boxes})
        end = 0
        for start, length in spans:
            if start != end:
                return False  # a gap or two overlapping cuts of this dimension
            end = start + length
        if end != total:
            return False
        cells *= len(spans)
    return cells == len(boxes) == len(set(boxes))


class SnapshotReader:
    """A snapshot whose manifest, state and shard metadata have been read and validated.

    `state` is the JSON state (core keys type-checked), `shards` the validated shard metadata;
    `read_chunk` and `full_tensor` return verified tensor bytes."""

    def __init__(self, snapshot: str):
        self.snapshot = snapshot
        self.store = Store(snapshot)
        try:
            self._open()
        except SnapshotCorruptError:
            raise
        except FileNotFoundError as error:
            raise SnapshotCorruptError(f"snapshot {snapshot} is incomplete: {error.filename or error} is missing") from None
        except (OSError, ValueError, TypeError, KeyError) as error:
            raise SnapshotCorruptError(f"snapshot {snapshot} cannot be read ({type(error).__name__}: {error})") from None

    # ---- opening: manifest, then everything it vouches for ----------------------------------

    def _open(self) -> None:
        name = self.snapshot.rstrip("/").rsplit("/", 1)[-1]
        match = SNAPSHOT_NAME.match(name)
        _require(match is not None, self.snapshot, f"{name!r} is not a snapshot name (step_ and 8 digits)")
        _require(self.store.is_directory(self.store.root), self.snapshot, "it is not a directory")
        for sub in ("rng", "shards"):
            path = self.store.path(sub)
            _require(not self.store.exists(path) or self.store.is_directory(path), self.snapshot,
                     f"{sub}/ is not a directory")
        data = self.store.read(self.store.path(MANIFEST), MAX_MANIFEST_BYTES)
        _require(len(data) <= MAX_MANIFEST_BYTES, self.snapshot, f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
        self.manifest = parse_json(data, self.snapshot, MANIFEST)
        self._check_manifest(int(match.group(1)))
        self.state = self.json(STATE)
        self._check_state()
        self.shards = self.json(SHARDS_METADATA)
        self._check_shards()

    def _check_manifest(self, step: int) -> None:
        manifest, where = self.manifest, self.snapshot
        _require(isinstance(manifest, dict), where, f"{MANIFEST} is not an object")
        _require(manifest.get("format") == FORMAT, where,
                 f"unknown format {str(manifest.get('format'))[:40]!r} (this triax reads {FORMAT})")
        _require(manifest.get("step") == step and is_int(manifest.get("step")), where,
                 f"{MANIFEST} names step {str(manifest.get('step'))[:20]}, the directory step {step}")
        _require(is_int(manifest.get("world_size")) and manifest["world_size"] >= 1, where,
                 f"{MANIFEST} has no valid world_size")
        files = manifest.get("files")
        _require(isinstance(files, dict), where, f"{MANIFEST} has no 'files' object")
        for relative, entry in files.items():
            _require(FILE_NAME.match(relative) is not None, where, f"{MANIFEST} lists an unexpected file {relative[:80]!r}")
            _require(isinstance(entry, dict) and is_count(entry.get("bytes"))
                     and isinstance(entry.get("sha256"), str) and SHA256.match(entry["sha256"]) is not None,
                     where, f"{MANIFEST} entry for {relative} needs integer 'bytes' and a hex 'sha256'")
        for required in (STATE, SHARDS_METADATA):
            _require(required in files, where, f"{MANIFEST} does not list {required}")

    def _check_state(self) -> None:
        state, where = self.state, self.snapshot
        _require(isinstance(state, dict), where, f"{STATE} is not an object")
        _require(state.get("step") == self.manifest["step"] and is_int(state.get("step")), where,
                 f"{STATE} step {str(state.get('step'))[:20]} differs from the manifest's")
        _require(is_int(state.get("world_size")) and state["world_size"] >= 1, where, f"{STATE} has no valid world_size")
        wrong = bad_number(state)
        _require(wrong is None, where, f"{STATE} holds {str(wrong)[:120]}, outside what that field allows")
        groups = state.get("optimizer_groups")
        _require(groups is None or (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)), where,
                 f"{STATE} optimizer_groups is not a list of objects")

    def _check_shards(self) -> None:
        shards, where, files = self.shards, self.snapshot, self.manifest["files"]
        _require(isinstance(shards, dict) and isinstance(shards.get("tensors"), dict)
                 and isinstance(shards.get("files"), dict), where, f"{SHARDS_METADATA} needs 'tensors' and 'files' objects")
        for relative, entry in shards["files"].items():
            _require(relative.startswith("shards/") and files.get(relative) == entry, where,
                     f"{SHARDS_METADATA} and {MANIFEST} disagree about {str(relative)[:80]!r}")
        listed = {relative for relative in files if relative.startswith("shards/")}
        _require(listed == set(shards["files"]), where, f"{MANIFEST} and {SHARDS_METADATA} list different shard files")
        for key, entry in shards["tensors"].items():
            self._check_tensor(key, entry)
        # No two chunks share bytes of a file: otherwise a small file could describe tensors of any
        # size (one 16 MiB range named by 256 chunks is a 4 GiB tensor). Sorted: O(n log n).
        ranges = sorted((chunk["file"], chunk["offset"], chunk["bytes"]) for entry in shards["tensors"].values()
                        for chunk in entry["chunks"] if chunk["bytes"] > 0)
        for (file_a, offset_a, bytes_a), (file_b, offset_b, _) in zip(ranges, ranges[1:]):
            _require(file_a != file_b or offset_a + bytes_a <= offset_b, where,
                     f"{SHARDS_METADATA}: two chunks share bytes of {file_a[:80]}")
        _require(self.state.get("optimizer_groups") is not None or not any(k.startswith("optim/") for k in shards["tensors"]),
                 where, f"{STATE} has no optimizer_groups but the shards hold optimizer state")
        # Every shard file is there with the size the manifest gives (cheap: no data is read).
        for relative in listed:
            size = self.store.size(self.store.path(*relative.split("/")))
            _require(size == files[relative]["bytes"], where,
                     f"{relative} has {size} bytes, the manifest says {files[relative]['bytes']} (truncated?)")

    def _check_tensor(self, key: str, entry: object) -> None:
        where = self.snapshot
        what = f"tensor {key[:80]!r} in {SHARDS_METADATA}"
        _require(isinstance(entry, dict) and entry.get("dtype") in DTYPES, where, f"{what} has no known dtype")
        size = entry.get("size")
        _require(isinstance(size, list) and len(size) <= MAX_DIMS and all(is_count(s) for s in size), where,
                 f"{what} has an invalid size")
        chunks = entry.get("chunks")
        _require(isinstance(chunks, list) and len(chunks) >= 1, where, f"{what} has no chunks")
        itemsize = torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()
        boxes = []
        for chunk in chunks:
            _require(isinstance(chunk, dict), where, f"{what} has a chunk that is not an object")
            offsets, sizes = chunk.get("offsets"), chunk.get("sizes")
            _require(isinstance(offsets, list) and isinstance(sizes, list) and len(offsets) == len(sizes) == len(size)
                     and all(is_count(v) for v in offsets + sizes)
                     and all(o + s <= total for o, s, total in zip(offsets, sizes, size)), where,
                     f"{what} has a chunk outside the tensor")
            file_entry = self.manifest["files"].get(chunk.get("file"))
            _require(isinstance(chunk.get("file"), str) and chunk["file"].startswith("shards/") and file_entry is not None,
                     where, f"{what} points at a file the manifest does not list")
            _require(is_count(chunk.get("offset")) and chunk.get("bytes") == math.prod(sizes) * itemsize
                     and chunk["offset"] + chunk["bytes"] <= file_entry["bytes"], where,
                     f"{what} has a chunk whose byte range does not fit its file")
            _require(isinstance(chunk.get("sha256"), str) and SHA256.match(chunk["sha256"]) is not None, where,
                     f"{what} has a chunk without a hex sha256")
            boxes.append((offsets, sizes))
        _require(sum(math.prod(s) for _, s in boxes) == math.prod(size), where, f"{what}: chunks do not cover it")
        _require(_tiles(boxes, size), where, f"{what}: chunks overlap")

    # ---- reading verified bytes -------------------------------------------------------------

    def has(self, relative: str) -> bool:
        return relative in self.manifest["files"]

    def read(self, relative: str) -> bytes:
        """A whole (small) file, checked against the manifest's size and sha256."""
        expected = self.manifest["files"].get(relative)
        _require(expected is not None, self.snapshot, f"{MANIFEST} does not list {relative}")
        limit = expected["bytes"]
        if relative.endswith(".json"):
            _require(limit <= MAX_JSON_BYTES, self.snapshot, f"{relative} is larger than {MAX_JSON_BYTES} bytes")
        try:
            data = self.store.read(self.store.path(*relative.split("/")), limit)
        except FileNotFoundError:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is incomplete: {relative} is missing") from None
        except OSError as error:
            raise SnapshotCorruptError(f"snapshot {self.snapshot}: cannot read {relative} ({error})") from None
        if len(data) != limit:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is truncated: {relative} has "
                                       f"{'more' if len(data) > limit else len(data)} bytes, the manifest says {limit}")
        if hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is corrupt: {relative} fails its sha256 checksum")
        return data

    def json(self, relative: str):
        return parse_json(self.read(relative), self.snapshot, relative)

    def read_chunk(self, chunk: dict) -> bytes:
        """One chunk's bytes, checked against its sha256 (the manifest vouches for the metadata)."""
        try:
            data = self.store.read_range(self.store.path(*chunk["file"].split("/")), chunk["offset"], chunk["bytes"])
        except OSError as error:
            raise SnapshotCorruptError(f"snapshot {self.snapshot}: cannot read {chunk['file']} ({error})") from None
        if len(data) != chunk["bytes"]:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is truncated: {chunk['file']} ends early")
        if hashlib.sha256(data).hexdigest() != chunk["sha256"]:
            raise SnapshotCorruptError(f"snapshot {self.snapshot} is corrupt: {chunk['file']} fails its sha256 checksum")
        return data

    def tensor_names(self) -> list[str]:
        return list(self.shards["tensors"])

    def tensor_info(self, key: str) -> tuple[torch.dtype, list[int]]:
        entry = self.shards["tensors"][key]
        return DTYPES[entry["dtype"]], list(entry["size"])

    def full_tensor(self, key: str) -> torch.Tensor:
        """One whole tensor, assembled from its verified chunks (the only one held at a time by a
        streaming caller such as export)."""
        dtype, size = self.tensor_info(key)
        result = torch.empty(size, dtype=dtype)
        for chunk in self.shards["tensors"][key]["chunks"]:
            piece = tensor_from_bytes(self.read_chunk(chunk), dtype, chunk["sizes"])
            target = result
            for dim, (start, length) in enumerate(zip(chunk["offsets"], chunk["sizes"])):
                target = target.narrow(dim, start, length)
            target.copy_(piece)
        return result


def open_snapshot(snapshot: str) -> SnapshotReader:
    return SnapshotReader(snapshot)
