"""Loading tensors whose last rows are padding: a vocabulary padded for tensor parallelism.

A vocabulary that tp does not divide is padded to a multiple of tp. The padding rows of the token
embedding and the head start at zero and never get a gradient (no id names them, their logits are
masked), so they and their AdamW moments stay zero: only the first `vocab_size` rows of those
tensors hold the model. A snapshot saved in one layout (161 rows at tp=1) is therefore the same
model as one saved in another (162 at tp=2, 164 at tp=4), and loads into any of them.

DCP refuses a saved tensor whose size differs from the target's. For these tensors the planner
below asks for the real rows only: each rank the part of its own shard (plain, tensor-parallel
or FSDP DTensor) that lies within them, read as byte ranges of the saved chunks like any
reshard, so nothing is gathered whole. The target's padding rows keep their zeros (a model's
padding starts at zero, its optimizer state too), and a snapshot's own padding is never read:
one written before the padding was masked may hold non-zero values there.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor


def _chunks(tensor: torch.Tensor) -> list[ChunkStorageMetadata]:
    """What this rank holds of `tensor`, as DCP describes it: a DTensor its local shard (none
    when this rank is outside its mesh), a plain tensor the whole."""
    if isinstance(tensor, DTensor):
        return tensor.__create_chunk_list__() if tensor.device_mesh.get_coordinate() is not None else []
    return [ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size())]


def _within(chunk: ChunkStorageMetadata, rows: int) -> ChunkStorageMetadata | None:
    """The part of `chunk` in the first `rows` rows (the same start, so offsets into the local
    tensor are unchanged), or None when it lies wholly in the padding."""
    start = chunk.offsets[0]
    if start >= rows:
        return None
    return ChunkStorageMetadata(offsets=chunk.offsets,
                                sizes=torch.Size([min(chunk.sizes[0], rows - start), *chunk.sizes[1:]]))


class PaddedRowsLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but for the keys of `real_rows` ({key: rows that hold data})
    only those rows are read, whatever padding the snapshot and the target have."""

    def __init__(self, real_rows: dict[str, int]):
        super().__init__()
        self.real_rows = real_rows

    def create_local_plan(self) -> LoadPlan:
        # The state dict is flat (triax's own keys): no older-DCP key forms to reconcile.
        rest = {key: value for key, value in self.state_dict.items() if key not in self.real_rows}
        items = list(create_default_local_load_plan(rest, self.metadata, strict=True).items)
        for key, rows in self.real_rows.items():
            items += self._real_row_reads(key, rows, self.state_dict[key])
        return LoadPlan(items)

    def _real_row_reads(self, key: str, rows: int, target: torch.Tensor) -> list:
        saved = self.metadata.state_dict_metadata.get(key)
        if saved is None:
            raise RuntimeError(f"Missing key in checkpoint state_dict: {key}.")
        if not isinstance(saved, TensorStorageMetadata) or len(saved.size) != target.dim() \
                or saved.size[1:] != target.size()[1:] or min(saved.size[0], target.size(0)) < rows:
            raise ValueError(f"Size mismatch between saved {getattr(saved, 'size', '?')} and current: "
                             f"{target.size()} for {key} (its first {rows} rows hold the model)")
        chunks = [part for chunk in _chunks(target) if (part := _within(chunk, rows)) is not None]
        return create_read_items_for_chunk_list(key, saved, chunks)

