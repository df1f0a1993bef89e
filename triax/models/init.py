"""Initial weights that do not depend on how the model is laid out across processes.

Each parameter's full tensor is defined by (seed, parameter name) alone: its rows are cut into
fixed blocks (the block size depends only on the row width), and block b is drawn from its own
generator seeded by a hash of (seed, name, b). A process that holds any slice of the parameter
(a tensor-parallel shard, an FSDP shard, a pipeline stage's layers, or all of it) draws only the
blocks that overlap its slice and keeps its part. So the values are the same in every layout and
in one process, whatever order modules are built in, and no process ever draws more than its own
slice plus one block.
"""

from __future__ import annotations

import hashlib
import math

import torch

# Values per generator block (4 MiB in fp32): the most any process draws beyond its own slice.
BLOCK_VALUES = 1 << 20


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit generator seed for one block of one parameter (stable across runs and machines)."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local values, global offset, global shape) of a plain tensor or a DTensor shard.

    Tensor and FSDP sharding (including FSDP over tensor-parallel shards) both cut contiguous
    chunks, so a shard is always a box of the full tensor: an offset and the local shape."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor.detach(), (0,) * tensor.dim(), tuple(tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = tensor.to_local().detach()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"cannot initialise a shard of shape {tuple(local.shape)} placed as {tensor.placements}: "
                           f"its placement describes a shard of shape {tuple(shape)}")
    return local, tuple(offset), tuple(tensor.shape)


@torch.no_grad()
def init_normal(tensor: torch.Tensor, seed: int, name: str, std: float, drawn_rows: int | None = None) -> int:
    """Fill this process's part of `tensor` (plain, or a DTensor shard) with its slice of the full
    N(0, std) tensor of `name`. Returns how many values were drawn.

    `drawn_rows`: only the first rows are random, the rest zero (a vocabulary padded for tensor
    parallelism: the real rows must not depend on how much padding there is)."""
    local, offset, full_shape = local_box(tensor)
    return fill_normal(local, offset, full_shape, seed, name, std, drawn_rows)


@torch.no_grad()
def fill_normal(local: torch.Tensor, offset: tuple[int, ...], full_shape: tuple[int, ...], seed: int, name: str,
                std: float, drawn_rows: int | None = None) -> int:
    """Fill `local`, the box at `offset` of a tensor of `full_shape`, with its part of the full
    tensor of `name` (see init_normal). Draws only the blocks that overlap the box."""
    if local.numel() == 0:
        return 0
    if not full_shape:
        raise ValueError(f"cannot initialise the scalar parameter {name!r} from a normal distribution")
    rows = full_shape[0] if drawn_rows is None else min(drawn_rows, full_shape[0])
    row_values = math.prod(full_shape[1:])
    rows_per_block = max(1, BLOCK_VALUES // max(1, row_values))
    first, count = offset[0], local.shape[0]
    stop = min(first + count, rows)
    inner = tuple(slice(start, start + size) for start, size in zip(offset[1:], local.shape[1:]))
    whole_rows = tuple(local.shape[1:]) == tuple(full_shape[1:])
    # Draw straight into the parameter where a block lands whole in it (the common case: one
    # process, or FSDP shards of many blocks); otherwise draw the block and copy our part.
    direct = whole_rows and local.dtype == torch.float32 and local.device.type == "cpu" and local.is_contiguous()
    drawn = 0
    for block in range(first // rows_per_block, -(-stop // rows_per_block) if stop > first else 0):
        block_start = block * rows_per_block
        block_rows = min(rows_per_block, rows - block_start)  # the full tensor decides, never the slice
        generator = torch.Generator().manual_seed(block_seed(seed, name, block))
        low, high = max(block_start, first), min(block_start + block_rows, stop)
        target = local[low - first:high - first]
        drawn += block_rows * row_values
        if direct and low == block_start and high == block_start + block_rows:
            target.normal_(0.0, std, generator=generator)
        else:
            values = torch.empty((block_rows, *full_shape[1:])).normal_(0.0, std, generator=generator)
            target.copy_(values[(slice(low - block_start, high - block_start), *inner)])
    if first + count > rows:
        local[max(0, rows - first):].zero_()
    return drawn


@torch.no_grad()
def init_constant(tensor: torch.Tensor, value: float) -> None:
    local, _, _ = local_box(tensor)
    local.fill_(value)
