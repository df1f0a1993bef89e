"""The output layer a chunk of positions at a time: losses and log-probabilities without the whole
logits tensor.

A loss over the vocabulary needs every position's logits. Held at once they are a (rows x length x
vocabulary) tensor, and in fp32 (the loss's precision) with Qwen's 151,936 words and 16 rows of
1,024 tokens that is 10 GB, written again by the softmax and kept for the backward. Here the final
hidden states (rows, length, width) are cut into chunks of `chunk_tokens` positions; each chunk
goes through the output layer (`head`: the decoder's `output_logits`, a padded vocabulary's unused
rows masked), its softmax gives its targets' values, and its logits are freed before the next
chunk. Under autograd each chunk is recomputed in the backward (torch.utils.checkpoint) instead of
saved, so the backward too holds one chunk's logits at a time; the price is one more pass of the
output layer's matmul. The numbers are those of the whole-logits path: the same fp32 softmax of
the same rows, summed in another order.

Tensor parallelism leaves the head's logits vocabulary-sharded (DTensors): a target's value is then
the negative log-likelihood that loss_parallel computes on each rank's columns (the caller runs the
forward and the backward under it, as the step does its loss), replicated.

Who chunks: GRPO always, 256 positions at a time (its completions' log-probabilities and
entropies); the token loss and DPO where a micro-batch's whole logits would pass
parallel.max_logits_mb, in chunks of that size (`chunk_positions`), and below it not at all: small
runs keep the one matmul and the compiled loss, and their numbers bit for bit. `triax eval` takes
the same decision for each batch it scores, and `triax plan` counts what it decides (the
arithmetic: triax.objectives.logits_budget).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from triax.data.targets import IGNORE_INDEX
# FP32_BYTES with the rest: what a caller of the chunks needs of their arithmetic, imported from here.
from triax.objectives.logits_budget import CPU_LOGITS_MB, FP32_BYTES, gpu_logits_limit_mb, positions_per_chunk

DEFAULT_CHUNK_TOKENS = 256  # positions per chunk: 256 x 151,936 fp32 logits = 156 MB


def logits_limit_mb(configured: float | None, device: torch.device) -> float:
    """parallel.max_logits_mb as the run applies it. Unset: 256 MB on a CPU, where the chunks cost
    nothing measurable and save the gigabytes a large vocabulary's logits take; a quarter of the
    device's memory on a GPU, where the whole logits' one matmul and compiled loss are the faster
    path (GPT-2's measured micro-batch of 64 x 1,024 tokens is 13 GB of fp32 logits, whole on an
    80 GB card) and the chunks are for what would not fit."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        return gpu_logits_limit_mb(torch.cuda.get_device_properties(device).total_memory)
    return CPU_LOGITS_MB


def output_layer(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decoder's output layer (final hidden states -> logits) of `model`, under DDP's wrapper or not."""
    return getattr(model, "module", model).output_logits


def chunk_positions(model: torch.nn.Module, targets: torch.Tensor, max_logits_mb: float) -> int:
    """Positions per chunk for the logits of `targets`' positions under `model` (a triax decoder,
    under DDP's wrapper or not) when at most `max_logits_mb` of fp32 logits may exist at once: every
    position (the whole logits, the path of every small run) where they fit or `max_logits_mb` is 0,
    else as many as fit (at least one). The whole vocabulary counts, even where tensor parallelism
    shards it: every rank holding the micro-batch decides alike."""
    return positions_per_chunk(targets.numel(), getattr(model, "module", model).config.vocab_rows, max_logits_mb)


def _in_chunks(function: Callable, head: Callable, hidden: torch.Tensor, targets: torch.Tensor,
               chunk_tokens: int, *extra) -> list[torch.Tensor]:
    """`function(head, hidden chunk, targets chunk, *extra)` -> a tuple of per-position tensors, run
    over chunks of `chunk_tokens` positions of the flattened (rows, length) positions; each output
    concatenated back to (rows, length)."""
    rows, length = targets.shape
    flat_hidden, flat_targets = hidden.reshape(rows * length, -1), targets.reshape(-1)
    # One chunk holds its logits until the backward either way: recomputing it would save nothing.
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad and rows * length > chunk_tokens
    parts = []
    for start in range(0, rows * length, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if recompute:
            parts.append(checkpoint(function, head, flat_hidden[part], flat_targets[part], *extra, use_reentrant=False))
        else:
            parts.append(function(head, flat_hidden[part], flat_targets[part], *extra))
    return [torch.cat(outputs).view(rows, length) for outputs in zip(*parts)]


def _chunk_logps(head: Callable, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    # At most two (chunk x vocabulary) tensors at once: the logits are dropped once the log-softmax
    # (which its backward keeps, not its input) exists, and the entropy's product is made in place.
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probabilities = F.log_softmax(logits, dim=-1)
    del logits
    if isinstance(log_probabilities, DTensor):
        # The chosen token's log-probability as the negative log-likelihood, which loss_parallel
        # computes on each rank's columns.
        chosen = (-F.nll_loss(log_probabilities, targets, reduction="none")).full_tensor()
    else:
        chosen = log_probabilities.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -log_probabilities.exp().mul_(log_probabilities).sum(-1)
    return chosen, entropy.full_tensor() if isinstance(entropy, DTensor) else entropy


def logps_of_hidden(head: Callable, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, entropies), each (rows, length), of `targets` (rows, length) under the
    logits `head` gives of `hidden` (rows, length, width) at `temperature`, `chunk_tokens` positions at a time."""
    logps, entropies = _in_chunks(_chunk_logps, head, hidden, targets, chunk_tokens, temperature)
    return logps, entropies


def _chunk_target_losses(head: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
    # The token loss's own arithmetic (triax.objectives.tokens.loss) on a chunk of positions.
    losses = F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return (losses.full_tensor() if isinstance(losses, DTensor) else losses,)


def target_losses(head: Callable, hidden: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """(rows, length) fp32 cross-entropy of each of `targets` (rows, length) under the logits `head`
    gives of `hidden` (rows, length, width), 0 where a target is IGNORE_INDEX, `chunk_tokens`
    positions at a time."""
    (losses,) = _in_chunks(_chunk_target_losses, head, hidden, targets, chunk_tokens)
    return losses


def reduce_target_losses(losses: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """target_losses' sum, or their mean over the targets that are not IGNORE_INDEX (as
    F.cross_entropy's mean: NaN where none is)."""
    total = losses.sum()
    return total if reduction == "sum" else total / (targets != IGNORE_INDEX).sum()


def bounded_cross_entropy(forward: Callable[..., torch.Tensor], model: torch.nn.Module, inputs: Any,
                        targets: torch.Tensor, reduction: str, whole_loss: Callable, max_logits_mb: float,
                        autocast: Callable[[], ContextManager]) -> torch.Tensor:
    """The cross-entropy (`reduction`: mean or sum) of `targets` after `inputs` under `model`:
    `whole_loss(logits, targets, reduction)` of the whole logits (`forward(model, inputs)`, under
    `autocast`) where they fit in `max_logits_mb`, else a chunk of positions at a time from the final
    hidden states (`forward(model, inputs, logits=False)`): the same fp32 losses, summed in another
    order. The training step's token loss and its validation loss both take it."""
    chunk = chunk_positions(model, targets, max_logits_mb)
    if chunk >= targets.numel():
        with autocast():
            logits = forward(model, inputs)
        return whole_loss(logits, targets, reduction)
    with autocast():
        hidden = forward(model, inputs, logits=False)
        losses = target_losses(output_layer(model), hidden, targets, chunk)
    return reduce_target_losses(losses, targets, reduction)
