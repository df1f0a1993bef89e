"""Fully sharded data parallelism (FSDP2, `fully_shard`), and HSDP on a 2-D mesh.

Each transformer block is its own FSDP unit, so its parameters are all-gathered just before its
forward/backward and freed after; the root unit holds the embeddings, final LayerNorm and head.
With a (dp_replicate, dp_shard) mesh FSDP2 shards within a group and replicates across groups
(HSDP): all-gathers stay inside a node while gradients are also all-reduced between nodes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from triax.precision import Precision


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """Parameters gathered in the compute dtype, gradients reduced in fp32.

    fp32 and bf16-pure need no casting: the parameters already are in the compute dtype.
    """
    if precision.uses_autocast:
        return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh, precision: Precision, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` (a GPT or a pipeline stage of one) over `dp_mesh` in place.

    `reshard_after_forward=False` keeps the gathered parameters between forward and backward:
    a pipeline runs several micro-batches' forwards before their backwards, and re-gathering for
    each would multiply the all-gather traffic.
    """
    policy = mixed_precision_policy(precision)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root unit: whatever the blocks did not take (embeddings, ln_f, head). The head's output is
    # the last thing forward needs, so there is nothing to gain by freeing it early.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def apply_fsdp_by_blocks(model: nn.Module, dp_mesh, precision: Precision) -> nn.Module:
    """Shard any `model` (not only a GPT) over `dp_mesh` in place: each trainable child of a
    ModuleList/ModuleDict (a transformer's blocks, wherever they sit) becomes its own unit, so only
    one block's full parameters exist at a time; the root takes the rest. Used by the Accelerator,
    whose users bring their own models."""
    policy = mixed_precision_policy(precision)
    for module in list(model.modules()):
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            for block in module.children():
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model
