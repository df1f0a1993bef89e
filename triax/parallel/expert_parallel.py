"""Expert parallelism (parallel.ep): each layer's experts split over `ep` ranks, tokens sent to the
rank that holds their expert and back with all-to-all, composed with FSDP as torchtitan does.

The `ep` ranks are borrowed from the fully-sharded ones (dp_shard = efsdp x ep): a 2-D mesh
(efsdp, ep) over them. The batched expert tensors become DTensors sharded along the expert
dimension over `ep`, and FSDP shards each rank's experts again over `efsdp` (along their width
when a rank holds fewer experts than efsdp: expert_shard_placement); every other parameter is
sharded over all dp_shard ranks as without EP. Data parallelism is unchanged: every
rank reads its own batch, routes its own tokens and gets their outputs back.

Gradients: an expert's gradient arrives whole on the rank that holds it (the all-to-all's backward
brings back the gradient of every token routed to it, from every ep rank), the sum over ep ranks'
batches; FSDP's reduction over `efsdp` then divides by efsdp only. The mean over all dp_shard ranks
that every other parameter gets needs a further 1/ep, applied to the gradient as it reaches the
weights (FSDP2's own gradient divide factor would reduce with PREMUL_SUM, which gloo lacks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from triax.models.experts import GroupedExperts
from triax.parallel.fsdp import mixed_precision_policy
from triax.runtime.precision import Precision

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def build_expert_mesh(dp_shard: int, ep: int, device_type: str) -> DeviceMesh:
    """The (efsdp, ep) mesh over the fully-sharded ranks (ep innermost: neighbouring ranks exchange tokens)."""
    return init_device_mesh(device_type, (dp_shard // ep, ep), mesh_dim_names=("efsdp", "ep"))


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh, precision: Precision) -> None:
    """Split every GroupedExperts' tensors over expert_mesh["ep"] and shard them over "efsdp" (the
    model on the meta device, before the blocks' FSDP, which then leaves them to these units)."""
    ep_mesh = expert_mesh["ep"]
    ep = ep_mesh.size()
    for experts in [module for module in model.modules() if isinstance(module, GroupedExperts)]:
        for name, parameter in list(experts.named_parameters(recurse=False)):
            local = torch.empty((parameter.size(0) // ep, *parameter.shape[1:]), dtype=parameter.dtype,
                                device=parameter.device)
            split = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                       shape=parameter.shape, stride=parameter.stride())
            setattr(experts, name, nn.Parameter(split, requires_grad=parameter.requires_grad))
        experts.ep_group = ep_mesh.get_group()
        experts.exchange = dispatch
        placement = expert_shard_placement(experts.gate_proj.size(0) // ep, expert_mesh["efsdp"].size())
        fully_shard(experts, mesh=expert_mesh["efsdp"], mp_policy=mixed_precision_policy(precision),
                    shard_placement_fn=placement)


def expert_shard_placement(local_experts: int, efsdp: int):
    """How FSDP shards a rank's experts over efsdp: along the expert dimension, as every other
    parameter; but when the rank holds fewer experts than efsdp, that would leave some ranks
    none and one a whole expert, so along the experts' width instead (torchtitan's choice), and
    each rank keeps 1/efsdp of every expert. None: FSDP's default (dim 0)."""
    return (lambda parameter: Shard(1)) if local_experts < efsdp else None


def dispatch(x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """The experts' outputs for rows `x` sorted by (global) expert, counts[e] of them for expert e,
    computed on the ranks that hold the experts: rows out by all-to-all, through this rank's
    experts (regrouped by expert), and back in their order."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd  # deferred: private API

    group = experts.ep_group
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    sent = counts.view(ep, local)  # rows for each destination rank, by its local expert
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)  # rows from each source rank, by my expert
    to_send, to_receive = sent.sum(1).tolist(), received.sum(1).tolist()
    rows = all_to_all_single_autograd(x, to_receive, to_send, group)
    # Rows arrive by source rank, then by expert: regroup them by expert (stable).
    expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.flatten())
    order = torch.argsort(expert_of_row, stable=True)
    out = experts.local_forward(rows[order], received.sum(0), lambda w: _ScaleGradient.apply(w.to_local(), 1.0 / ep))
    restored = torch.empty_like(out).index_copy(0, order, out)  # back in arrival order
    return all_to_all_single_autograd(restored, to_send, to_receive, group)


class _ScaleGradient(torch.autograd.Function):
    """The identity, whose gradient is scaled by `factor`."""

    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        return grad * ctx.factor, None
