"""Data parallelism by PyTorch's DistributedDataParallel."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from triax.parallel.comm_hooks import check_compression, register_compression
from triax.runtime.process_group import is_distributed

if TYPE_CHECKING:
    import torch.distributed as dist


def apply_ddp(model: nn.Module, device: torch.device, process_group: dist.ProcessGroup | None = None,
              bucket_mb: float = 25.0, grad_compression: str = "none",
              powersgd_rank: int = 2, ddp_options: dict | None = None) -> nn.Module:
    """Wrap `model` in DDP when the job has more than one process; return it unchanged otherwise.

    Gradients are averaged across processes in buckets of `bucket_mb` MB that start reducing while
    backward is still running (DDP's overlap). `grad_compression` picks what goes on the wire
    (see triax.parallel.comm_hooks); with one process nothing is sent, so it has no effect.
    `ddp_options` are further DistributedDataParallel arguments (e.g. find_unused_parameters).
    """
    check_compression(grad_compression, powersgd_rank)
    if not is_distributed():
        return model
    options = dict(
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
        bucket_cap_mb=bucket_mb,
        # Parameters that already match the model's layout need no copy into buckets.
        gradient_as_bucket_view=True,
    )
    options.update(ddp_options or {})
    ddp_model = DistributedDataParallel(model, **options)
    register_compression(ddp_model, grad_compression, powersgd_rank, process_group)
    return ddp_model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under DDP or torch.compile wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
