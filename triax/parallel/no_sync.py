"""Skipping (and forcing) the gradient reduction of a backward pass, for DDP and FSDP2 alike.

Gradient accumulation runs several backwards per optimizer step; only the last needs the
all-reduce (DDP) or reduce-scatter (FSDP2). Used by the trainer and the Accelerator.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Backward passes inside the block accumulate gradients locally, without communication.
    A model that is neither DDP nor FSDP2 (one process) needs nothing."""
    if isinstance(model, DistributedDataParallel) or callable(getattr(model, "no_sync", None)):
        # DDP, or a wrapper that forwards to it (torch.compile's OptimizedModule).
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2's fully_shard
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


@contextlib.contextmanager
def sync_in_backward(model: nn.Module):
    """The backward inside the block reduces gradients even within an enclosing `no_sync`
    (after several forwards under no_sync, the last backward brings everything in sync)."""
    if isinstance(model, DistributedDataParallel):
        saved = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        # DDP prepares its reducer in forward; the forward ran under no_sync, so prepare it now.
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = saved
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(True)
        yield
    else:
        yield
