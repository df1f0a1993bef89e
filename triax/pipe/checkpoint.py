"""Running one partition on one micro-batch, with or without activation recomputation.

Checkpointing keeps only a partition's input for each micro-batch and runs the partition again
during backward to rebuild what the gradients need, trading compute for memory. We use
`torch.utils.checkpoint` (non-reentrant); two things around it are the pipe's own business:

* Layers must know when they are being recomputed, so a `DeferredBatchNorm` does not count the
  same micro-batch twice. `is_recomputing()` answers that, per thread: recomputation runs in
  the backward thread while forward work runs in the partition workers.
* A plain BatchNorm would update its running statistics a second time while being recomputed;
  its statistics are put back afterwards, so checkpointing never changes them.
* Random numbers. PyTorch's checkpoint saves the generator state when the forward starts and
  restores it when recomputing, so dropout draws the same mask twice. Partitions running at the
  same time in several threads share the CPU generator (and a CUDA device's generator when two
  partitions sit on one GPU): another thread could draw from it in between, and the recomputed
  mask would differ from the forward one, silently corrupting gradients. A partition that draws
  random numbers therefore holds its device's generator lock while it runs.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from triax.pipe.microbatch import Batch, rebuild, tensors_of

CHECKPOINT_MODES = ("always", "except_last", "never")

_thread_state = threading.local()

# Modules that draw from the default generator in training mode.
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)

_generator_locks: dict[str, threading.Lock] = {}
_generator_locks_guard = threading.Lock()


def is_recomputing() -> bool:
    """True while the current thread re-runs a forward pass for checkpointing."""
    return getattr(_thread_state, "recomputing", False)


@contextlib.contextmanager
def _recomputing(flag: bool):
    previous = is_recomputing()
    _thread_state.recomputing = flag
    try:
        yield
    finally:
        _thread_state.recomputing = previous


def checkpoint_stop(mode: str, num_micro_batches: int, training: bool) -> int:
    """Micro-batches with an index below this are checkpointed.

    'except_last' spares the last micro-batch: its backward starts right after its forward, so
    recomputing it would only cost time. Nothing is recomputed when no gradients are wanted.
    """
    if not training or not torch.is_grad_enabled():
        return 0
    return {"always": num_micro_batches, "except_last": num_micro_batches - 1, "never": 0}[mode]


def draws_random_numbers(partition: nn.Module) -> bool:
    """Whether the partition, as it stands, uses the random generator in its forward pass."""
    return any(isinstance(layer, _RANDOM_MODULES) and layer.training for layer in partition.modules())


def generator_lock(device: torch.device) -> threading.Lock:
    """The lock guarding the default random generator that `device` draws from."""
    key = "cpu" if device.type == "cpu" else str(device)
    with _generator_locks_guard:
        return _generator_locks.setdefault(key, threading.Lock())


@contextlib.contextmanager
def _batch_norm_statistics_kept(partition: nn.Module):
    """Undo what a recomputation does to the running statistics of plain BatchNorm layers."""
    layers = [layer for layer in partition.modules()
              if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training and layer.track_running_stats]
    saved = [[buffer.clone() for buffer in layer.buffers(recurse=False)] for layer in layers]
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, buffers in zip(layers, saved):
                for buffer, value in zip(layer.buffers(recurse=False), buffers):
                    buffer.copy_(value)


def run_partition(partition: nn.Module, batch: Batch, checkpoint: bool) -> Batch:
    """Forward `batch` through `partition`, keeping activations or only the input (checkpoint)."""
    if not checkpoint:
        return partition(batch)
    calls = 0

    def forward(*tensors):
        # The first call is the forward pass; any later one is recomputation during backward.
        nonlocal calls
        calls += 1
        if calls == 1:
            return partition(rebuild(tensors, batch))
        with _recomputing(True), _batch_norm_statistics_kept(partition):
            return partition(rebuild(tensors, batch))

    return torch_checkpoint(forward, *tensors_of(batch), use_reentrant=False, preserve_rng_state=True)
