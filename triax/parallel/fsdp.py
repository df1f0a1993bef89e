"""Fully sharded data parallelism (FSDP2, `fully_shard`), and HSDP on a 2-D mesh.

Each transformer block is its own FSDP unit, so its parameters are all-gathered just before its
forward/backward and freed after; the root unit holds the embeddings, final LayerNorm and head.
With a (dp_replicate, dp_shard) mesh FSDP2 shards within a group and replicates across groups
(HSDP): all-gathers stay inside a node while gradients are also all-reduced between nodes.

With `cpu_offload` (ZeRO-Offload's idea, by FSDP2's CPUOffloadPolicy) the sharded parameters,
their gradients and therefore the optimizer state live in host memory: each unit's parameters are
copied to the device for its forward/backward, gradients go back to the host after the
reduce-scatter, and the optimizer steps on the CPU. Device memory then holds only the gathered
units in use and the activations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from triax.runtime.precision import Precision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """Parameters gathered in the compute dtype, gradients reduced in fp32.

    fp32 and bf16-pure need no casting: the parameters already are in the compute dtype.
    """
    if precision.uses_autocast:
        return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision, reshard_after_forward: bool = True,
               cpu_offload: bool = False) -> nn.Module:
    """Shard `model` (a GPT or a pipeline stage of one) over `dp_mesh` in place.

    Works on a model on the meta device too (then materialise it with `to_empty` on the device
    `sharded_parameter_device` names, and initialise it): only this rank's shards are allocated.

    `reshard_after_forward=False` keeps the gathered parameters between forward and backward:
    a pipeline runs several micro-batches' forwards before their backwards, and re-gathering for
    each would multiply the all-gather traffic.
    """
    policy = mixed_precision_policy(precision)
    offload = offload_policy(cpu_offload, dp_mesh.device_type)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    # The root unit: whatever the blocks did not take (embeddings, ln_f, head). The head's output is
    # the last thing forward needs, so there is nothing to gain by freeing it early.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False, offload_policy=offload)
    return model


def each_block(model: nn.Module) -> list[nn.Module]:
    """triax's FSDP units for any model (not only a GPT): each trainable child of a ModuleList or
    ModuleDict (a transformer's blocks, wherever they sit), so only one block's full parameters
    exist at a time; the root takes the rest."""
    return [block for module in model.modules() if isinstance(module, (nn.ModuleList, nn.ModuleDict))
            for block in module.children() if any(p.requires_grad for p in block.parameters())]


def offload_policy(cpu_offload: bool, device_type: str, pin_memory: bool = True) -> OffloadPolicy:
    """FSDP2's policy for keeping shards in host memory. Pinned memory makes the host-to-device
    copies asynchronous; there is nothing to pin for without a GPU."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=pin_memory and device_type == "cuda")


def shard_units(model: nn.Module, mesh: DeviceMesh, units: list, *, mp_policy: MixedPrecisionPolicy,
                reshard_after_forward: bool, offload: OffloadPolicy, ignored_params: set | None = None,
                last_units: list | None = None) -> nn.Module:
    """Shard `model` over `mesh` in place: each entry of `units` (a module, or a list of modules
    sharing one all-gather) becomes its own FSDP unit, then the root takes what is left.
    `last_units` are gathered for the end of forward (final norm, head) and kept until backward
    (resharding them would only re-gather at once). The root follows torch's rule for
    reshard_after_forward (False: its parameters are needed again first in backward)."""
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload, ignored_params=ignored_params)
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)
    for unit in last_units or []:
        fully_shard(unit, reshard_after_forward=False, **options)
    fully_shard(model, **options)
    return model


def sharded_parameter_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where FSDP keeps this rank's parameter shards: in host memory when offloaded."""
    return torch.device("cpu") if cpu_offload else device
