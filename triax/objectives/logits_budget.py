"""The arithmetic of parallel.max_logits_mb, without torch.distributed: how many positions' fp32
logits fit in the limit, the limit a GPU run leaves unset, and what a chunk holds at its peak.
The loss (triax.objectives.chunked_logits) decides its chunks by it and `triax plan`, whose answer
must not wait for the distributed packages, counts them by it."""

from __future__ import annotations

FP32_BYTES = 4  # the loss's logits are fp32 whatever the compute dtype
CPU_LOGITS_MB = 256.0  # the default limit on a CPU (chunked_logits.logits_limit_mb)
DEVICE_MEMORY_SHARE = 4  # the default limit on a GPU: a quarter of its memory
# A chunk's peak: its fp32 logits, their log-softmax and, in the backward, its gradient (about three
# chunks' logits, measured on a CPU: docs/performance.md, "SFT and DPO: the logits in chunks").
CHUNK_BYTES_PER_LOGIT = 3 * FP32_BYTES


def gpu_logits_limit_mb(memory_bytes: float) -> float:
    """The unset limit on a GPU of `memory_bytes`: a quarter of it, in MB."""
    return memory_bytes / DEVICE_MEMORY_SHARE / 2**20


def positions_per_chunk(positions: int, vocabulary: int, max_logits_mb: float) -> int:
    """Of `positions` positions' logits over `vocabulary` rows of the output layer, as many as fit
    in `max_logits_mb` of fp32: all where they fit or it is 0, else at least one."""
    if not max_logits_mb:
        return positions
    return max(1, min(positions, int(max_logits_mb * 2**20) // (vocabulary * FP32_BYTES)))
