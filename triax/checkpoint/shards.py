"""Tensor shards through torch.distributed.checkpoint (DCP), stored without pickle.

DCP plans who writes what (each rank its own shards; replicated tensors once) and, on load, who
reads which byte ranges to fill whatever layout the model has now (resharding). Its stock file
storage pickles its metadata and reads tensors with torch.load; this storage writes each rank's
shards as raw bytes into `shards/rank_NNNNN.bin` and the metadata as JSON (`shards.json`), with
the sha256 of every chunk, so a reader verifies exactly the bytes it reads and never unpickles.
The files' format (and the bytes of one tensor) is triax/checkpoint/shard_format.py's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, TYPE_CHECKING

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from triax.checkpoint.shard_format import DTYPE_NAMES, DTYPES, shard_file, tensor_bytes, tensor_from_bytes
from triax.checkpoint.storage import Store

if TYPE_CHECKING:
    import os

    from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

    from triax.checkpoint.reader import SnapshotReader


class ShardWriter(StorageWriter):
    """Each rank writes the items DCP planned for it into one file of the staging directory.
    `on_finish(shards_json_bytes)` runs on the coordinator once every rank's file is durable."""

    def __init__(self, store: Store, directory: str, on_finish: Callable[[bytes], None]):
        super().__init__()
        self.store, self.directory, self.on_finish = store, directory, on_finish
        self.rank = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank", 0) or 0

    def prepare_local_plan(self, plan: SavePlan):
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]):
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        relative = shard_file(self.rank)
        results, offset, whole = [], 0, hashlib.sha256()
        items = [item for item in plan.items]
        if any(item.type == WriteItemType.BYTE_IO for item in items):
            raise TypeError("a snapshot stores tensors only; non-tensor state belongs in its JSON state")
        if items:
            with self.store.open_new(self.store.join(self.directory, *relative.split("/"))) as handle:
                for item in items:
                    tensor = planner.resolve_data(item)
                    data = tensor_bytes(tensor.detach().cpu())
                    handle.write(data)
                    whole.update(data)
                    results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data={
                        "file": relative, "offset": offset, "bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest()}))
                    offset += len(data)
                self.store.flush_and_sync(handle)
            for result in results:
                result.storage_data["file_bytes"] = offset
                result.storage_data["file_sha256"] = whole.hexdigest()
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        stored = {result.index: result.storage_data for per_rank in results for result in per_rank}
        tensors, files = {}, {}
        for key, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata):
                raise TypeError(f"a snapshot stores tensors only, not {key!r}")
            chunks = []
            for chunk in entry.chunks:
                where = stored[MetadataIndex(key, chunk.offsets)]
                chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": where["file"],
                               "offset": where["offset"], "bytes": where["bytes"], "sha256": where["sha256"]})
                files[where["file"]] = {"bytes": where["file_bytes"], "sha256": where["file_sha256"]}
            tensors[key] = {"dtype": DTYPE_NAMES[entry.properties.dtype], "size": list(entry.size),
                            "chunks": chunks}
        self.on_finish(json.dumps({"tensors": tensors, "files": files}, separators=(",", ":")).encode())

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike | None) -> bool:
        return False


class ShardReader(StorageReader):
    """Reads the chunks DCP's load plan asks for from a snapshot that `snapshot_reader` (a
    triax.checkpoint.reader.SnapshotReader) has already validated; every chunk read is checked
    against its sha256. Counts the bytes it reads."""

    def __init__(self, snapshot_reader: SnapshotReader):
        super().__init__()
        self.snapshot = snapshot_reader
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries, storage = {}, {}
        for key, entry in self.snapshot.shards["tensors"].items():
            dtype = DTYPES[entry["dtype"]]
            chunks = []
            for chunk in entry["chunks"]:
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk["offsets"]), sizes=torch.Size(chunk["sizes"])))
                storage[MetadataIndex(key, chunk["offsets"])] = chunk
            entries[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                                 size=torch.Size(entry["size"]), chunks=chunks)
        return Metadata(state_dict_metadata=entries, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Every rank maps chunks from its own validated copy, not from the coordinator's broadcast.
        self.storage = self.read_metadata().storage_data

    def prepare_local_plan(self, plan: LoadPlan):
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]):
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for request in plan.items:
            if request.type == LoadItemType.BYTE_IO:
                raise TypeError("a snapshot holds tensors only")
            key = request.storage_index.fqn
            chunk = self.storage[MetadataIndex(key, request.storage_index.offset)]
            tensor = self.read_chunk(key, chunk)
            for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths)):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(request).detach()
            target.copy_(tensor)
            planner.commit_tensor(request, target)
        future: Future = Future()
        future.set_result(None)
        return future

    def read_chunk(self, key: str, chunk: dict) -> torch.Tensor:
        data = self.snapshot.read_chunk(chunk)
        self.bytes_read += len(data)
        return tensor_from_bytes(data, DTYPES[self.snapshot.shards["tensors"][key]["dtype"]], chunk["sizes"])

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike | None) -> bool:
        return False
