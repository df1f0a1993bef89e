"""Gradient-norm clipping for any layout.

torch.nn.utils.clip_grad_norm_ stacks per-parameter norms, which fails when parameters are
DTensors on different meshes (FSDP x TP gives 2-D parameters, while the un-split LayerNorms of a
non-sequence-parallel stage are 1-D) and cannot see the other pipeline stages' parameters. Here
the norm is taken per group of identically-placed parameters, made a plain number on every rank
(DTensor's `full_tensor` sums the squares of shards), then summed over the pipeline stages.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist


def _placement_key(grad: torch.Tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        return (id(grad.device_mesh), tuple(grad.placements))
    return None


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients in place to global `norm_type`-norm `max_norm` (inf: measure only); returns
    the norm before clipping, equal on every rank."""
    from torch.distributed.tensor import DTensor

    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = {}
    for grad in grads:
        groups.setdefault(_placement_key(grad), []).append(grad)
    # Per group the norm is a plain number on every rank; groups (and pipeline stages) combine by
    # max for the inf-norm, else by summing p-th powers.
    parts = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, foreach=None)
        if isinstance(norm, DTensor):
            if norm.device.type != norm.device_mesh.device_type:
                # CPU-offloaded FSDP shards on a GPU mesh: the collective runs on the mesh's device.
                norm = DTensor.from_local(norm.to_local().to(norm.device_mesh.device_type), norm.device_mesh,
                                          norm.placements, run_check=False)
            norm = norm.full_tensor()
        parts.append(norm.float() if math.isinf(norm_type) else norm.float() ** norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        total = torch.stack([part.to(parts[0].device) for part in parts]).max() if parts else torch.zeros((), device=device)
        if pp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
    else:
        total_powers = torch.stack([part.to(parts[0].device) for part in parts]).sum() if parts else torch.zeros((), device=device)
        if pp_group is not None:
            dist.all_reduce(total_powers, group=pp_group)
        total = total_powers.sqrt() if norm_type == 2.0 else total_powers ** (1.0 / norm_type)
    if math.isfinite(max_norm):
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(locals_, coefficient.to(device))
    return total
