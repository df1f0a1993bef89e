"""Gradient-norm clipping for any layout.

torch.nn.utils.clip_grad_norm_ stacks per-parameter norms, which fails when parameters are
DTensors on different meshes (FSDP x TP gives 2-D parameters, while the un-split LayerNorms of a
non-sequence-parallel stage are 1-D) and cannot see the other pipeline stages' parameters. Here
the norm is taken per group of identically-placed parameters, made a plain number on every rank
(DTensor's `full_tensor` sums the squares of shards), then summed over the pipeline stages.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _placement_key(grad: torch.Tensor):
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        return (id(grad.device_mesh), tuple(grad.placements))
    return None


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip gradients in place to global norm `max_norm` (inf: measure only); returns the norm
    before clipping, equal on every rank."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = {}
    for grad in grads:
        groups.setdefault(_placement_key(grad), []).append(grad)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=None)
        if isinstance(norm, DTensor):
            if norm.device.type != norm.device_mesh.device_type:
                # CPU-offloaded FSDP shards on a GPU mesh: the collective runs on the mesh's device.
                norm = DTensor.from_local(norm.to_local().to(norm.device_mesh.device_type), norm.device_mesh,
                                          norm.placements, run_check=False)
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = (torch.stack([square.to(squares[0].device) for square in squares]).sum() if squares
                else torch.zeros((), device=device))
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if math.isfinite(max_norm):
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(locals_, coefficient.to(device))
    return total
