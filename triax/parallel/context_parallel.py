"""Context parallelism: one sequence cut over the cp ranks of a group, each rank holding the
activations of its part only; attention gathers the keys and values of the whole sequence.

Load balance (the Llama 3 paper's scheme, also torchtitan's): the sequence is cut into 2 x cp
chunks and rank r holds chunks r and 2cp-1-r. Under a causal mask a query sees only earlier keys,
so a rank holding the end of the sequence alone would do most of the work; paired, every rank's
two chunks see (r + 1) + (2cp - r) = 2cp + 1 chunks of keys, the same on every rank.

Keys and values are all-gathered across the group in every attention layer (differentiable: the
gradient of each rank's keys is the sum of what every rank's queries sent back). Grouped-query
attention gathers only its key/value heads. Each local query chunk then attends to the keys up to
its own end: on a CPU by the fused attention kernel without a mask, gathering the keys and values
again in backward rather than keeping them (chunk_attention); for packed rows (only its own
example), with dropout or on other devices by PyTorch's scaled_dot_product_attention with each
chunk's mask. Positions (rotary or learned) are each token's place in the whole
sequence, so the numbers are those of one process holding it all.

Applied from outside: `apply_context_parallel` gives the model a `context` that its forward asks
for the positions and the attention of its slice (triax.models.decoder); the trainer feeds each
rank its slice of the ids and targets (`local_chunks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from triax.models.decoder import Packed

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx
    from torch.distributed.device_mesh import DeviceMesh


def local_chunks(x: torch.Tensor, rank: int, degree: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `x` along `dim` (the sequence): chunks rank and 2 x degree - 1 - rank
    of its 2 x degree equal chunks, in that order."""
    if degree == 1:
        return x
    chunks = x.unflatten(dim, (2 * degree, x.size(dim) // (2 * degree)))
    picked = chunks.index_select(dim, torch.tensor([rank, 2 * degree - 1 - rank], device=x.device))
    return picked.flatten(dim, dim + 1)


class _AllGather(torch.autograd.Function):
    """(cp, *x.shape): every rank's x, in rank order. Backward sums each rank's gradient over the
    group and hands every rank its own part."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        grad = grad.contiguous()
        rank = dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) == dist.Backend.GLOO:  # gloo has no reduce-scatter
            dist.all_reduce(grad, group=ctx.group)
            return grad[rank], None
        mine = torch.empty_like(grad[rank])
        dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
        return mine, None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, degree: int) -> torch.Tensor:
    """(batch, heads, whole sequence, head size) from every rank's (batch, heads, its 2 chunks,
    head size), in sequence order."""
    stacked = _AllGather.apply(local, group)  # (cp, batch, heads, 2 chunks, head size)
    halves = stacked.unflatten(3, (2, -1))  # (cp, batch, heads, 2, chunk, head size)
    # Rank r's first chunk is chunk r, its second chunk 2cp-1-r: the second halves in reverse rank order.
    ordered = torch.cat((halves[:, :, :, 0], halves[:, :, :, 1].flip(0)))  # (2cp, batch, heads, chunk, hs)
    return ordered.permute(1, 2, 0, 3, 4).flatten(2, 3)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp of each query's scores) of PyTorch's fused CPU attention kernel; k and v
    may have fewer heads (grouped-query attention: the kernel shares them, without copies)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    starts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of causal attention of this rank's query chunks (batch, heads, chunks,
    head size; chunk i starting at position starts[i]) over the whole sequence's keys and values,
    without a mask tensor: a chunk attends to the keys before it in full and to its own positions
    causally (a square causal block), two calls of the fused kernel merged by their log-sum-exps.
    (A (chunk, keys) mask would be kept per layer for backward, more memory than the cut saves.)"""
    chunk = q.size(2) // len(starts)
    outputs, sums = [], []
    for index, start in enumerate(starts):
        rows = q[:, :, index * chunk:(index + 1) * chunk]
        out, lse = _flash(rows, k[:, :, start:start + chunk], v[:, :, start:start + chunk], True)
        if start:
            before, before_lse = _flash(rows, k[:, :, :start], v[:, :, :start], False)
            merged = torch.logaddexp(before_lse, lse)
            out = (before.float() * (before_lse - merged).exp()[..., None]
                   + out.float() * (lse - merged).exp()[..., None]).to(q.dtype)
            lse = merged
        outputs.append(out)
        sums.append(lse)
    return torch.cat(outputs, dim=2), torch.cat(sums, dim=2)


def chunk_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, starts: tuple[int, ...]):
    """(dq, dk, dv) of `chunk_attention`, dk and dv for the whole sequence's keys and values: the
    kernel's backward on each part with the merged output and log-sum-exp gives each part's exact
    share of the gradient (as ring attention does)."""
    chunk = q.size(2) // len(starts)
    grad = grad.contiguous()
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    for index, start in enumerate(starts):
        rows = slice(index * chunk, (index + 1) * chunk)
        g, r, o, m = grad[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows]
        own = slice(start, start + chunk)
        dq_part, dk_part, dv_part = backward(g, r, k[:, :, own], v[:, :, own], o, m, 0.0, True)
        dk[:, :, own] += dk_part
        dv[:, :, own] += dv_part
        if start:
            dq_before, dk_before, dv_before = backward(g, r, k[:, :, :start], v[:, :, :start], o, m, 0.0, False)
            dq_part = dq_part + dq_before
            dk[:, :, :start] += dk_before
            dv[:, :, :start] += dv_before
        dq[:, :, rows] = dq_part
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _reduce_to_ranks(full: torch.Tensor, split: "ContextSplit") -> torch.Tensor:
    """This rank's chunks of the sum over the group of every rank's whole-sequence gradient."""
    if dist.get_backend(split.group) == dist.Backend.GLOO:  # gloo has no reduce-scatter
        dist.all_reduce(full, group=split.group)
        return local_chunks(full, split.rank, split.degree, dim=2)
    by_rank = torch.stack([local_chunks(full, rank, split.degree, dim=2) for rank in range(split.degree)])
    mine = torch.empty_like(by_rank[0])
    dist.reduce_scatter_tensor(mine, by_rank, group=split.group)
    return mine


class _GatheredChunkAttention(torch.autograd.Function):
    """chunk_attention over keys and values all-gathered from the group, which are not kept for
    backward: backward gathers them again (one more all-gather per layer instead of holding the
    whole sequence's keys and values for every layer), then sums each rank's key and value
    gradients over the group."""

    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: "ContextSplit",
                starts: tuple[int, ...]) -> torch.Tensor:
        keys, values = (gather_sequence(x, split.group, split.degree) for x in (k, v))
        out, lse = chunk_attention(q, keys, values, starts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.starts = split, starts
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        split = ctx.split
        keys, values = (gather_sequence(x, split.group, split.degree) for x in (k, v))
        dq, dk, dv = chunk_attention_backward(grad, q, keys, values, out, lse, ctx.starts)
        return dq, _reduce_to_ranks(dk, split), _reduce_to_ranks(dv, split), None, None


class ContextSlice:
    """One forward's view of this rank's slice: each token's position in the whole sequence and
    the attention of its queries over the gathered keys. Takes the place of decoder.Packed (the
    model asks it for `positions` and `attend`), for packed rows too."""

    def __init__(self, split: "ContextSplit", local_seq: int, documents: torch.Tensor | None,
                 device: torch.device):
        degree, rank = split.degree, split.rank
        self.split = split
        self.chunk = local_seq // 2
        whole = local_seq * degree
        self.chunk_ids = (rank, 2 * degree - 1 - rank)
        key_positions = torch.arange(whole, device=device)
        if documents is None:
            self.positions = local_chunks(key_positions, rank, degree, dim=0)
        else:
            self.positions = local_chunks(Packed.positions_of(documents), rank, degree)
        self.documents, self.key_positions = documents, key_positions
        self._masks = None

    def masks(self) -> list[torch.Tensor]:
        """Per local chunk, which of the keys up to its end it sees (causal; within its own example
        for packed rows). Built once per forward, shared by every layer."""
        if self._masks is None:
            self._masks, documents = [], self.documents
            for chunk_id in self.chunk_ids:
                end = (chunk_id + 1) * self.chunk
                mask = self.key_positions[None, :end] <= self.key_positions[chunk_id * self.chunk:end, None]
                if documents is not None:
                    rows = documents[:, chunk_id * self.chunk:end]
                    mask = (mask & (rows[:, :, None] == documents[:, None, :end]))[:, None]
                self._masks.append(mask)
        return self._masks

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        """Attention of this rank's queries (batch, heads, 2 chunks, head size) over the keys and
        values of the whole sequence, gathered from the group (only the key/value heads). On a CPU
        without packing or dropout by the fused kernel without a mask, the gathered keys and values
        not kept for backward (_GatheredChunkAttention); otherwise by scaled_dot_product_attention
        with each chunk's mask, the gathered keys and values kept by autograd."""
        if self.documents is None and not dropout and q.device.type == "cpu":
            starts = tuple(chunk_id * self.chunk for chunk_id in self.chunk_ids)
            return _GatheredChunkAttention.apply(q, k, v, self.split, starts)
        k = gather_sequence(k, self.split.group, self.split.degree)
        v = gather_sequence(v, self.split.group, self.split.degree)
        outputs = []
        for half, mask in enumerate(self.masks()):
            end = mask.size(-1)
            rows = q[:, :, half * self.chunk:(half + 1) * self.chunk]
            outputs.append(F.scaled_dot_product_attention(rows, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                                          dropout_p=dropout, enable_gqa=k.size(1) != q.size(1)))
        return torch.cat(outputs, dim=2)


class ContextSplit:
    """What a model under context parallelism knows of its group: `slice(...)` for each forward."""

    def __init__(self, group: dist.ProcessGroup, degree: int, rank: int):
        self.group, self.degree, self.rank = group, degree, rank

    def slice(self, local_seq: int, documents: torch.Tensor | None, device: torch.device) -> ContextSlice:
        return ContextSlice(self, local_seq, documents, device)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make `model` (a Decoder) take this rank's slice of each sequence over `cp_mesh`'s group."""
    model.context = ContextSplit(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
    return model
