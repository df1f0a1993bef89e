"""Tensor and sequence parallelism for every model family, by DTensor's `parallelize_module`.

A block's plan is its family's (FamilySpec.tp_plan: module names and the names of their styles,
turned into PyTorch's parallel styles here); for the families triax has it is Megatron-LM's:
- q/k/v projections and the MLP up-projection (and the llama family's gate projection) are
  column-parallel: each rank computes some heads / some hidden units, with no communication; with
  grouped-query attention each rank holds n_head / tp query heads and n_kv_head / tp key/value
  heads, so every query head finds its key/value head on the same rank (tp must divide n_kv_head);
- the attention output projection and the MLP down-projection are row-parallel: partial sums that
  are reduce-scattered along the sequence;
- LayerNorms / RMSNorms and dropout run sequence-parallel: between the parallel regions each rank holds a
  slice of the sequence, so their activations are not replicated tp times; Qwen3's per-head q/k
  norms run on each rank's heads with replicated gains;
- the token embedding is vocabulary-parallel (each rank holds 1/tp of the rows) and the head
  is column-parallel over the vocabulary. With `loss_parallel` the logits stay sharded and the
  cross-entropy is computed without ever gathering the (batch, seq, vocab) tensor; a padded
  vocabulary's mask then works on each rank's columns of the logits;
- a routed MLP (a mixture of experts) runs whole on every rank ("whole"): its tokens' sorting and
  grouped matmuls have no DTensor rules, and its weights are replicated rather than split.
"""

from __future__ import annotations

from typing import Any, Callable, TYPE_CHECKING

import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from triax.models.family import spec_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# A family's style names (triax/models/block_parts.py) -> the parallel style each stands for.
STYLES: dict[str, Callable[[], Any]] = {
    "colwise": ColwiseParallel,
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "sequence": SequenceParallel,
    "gather_sequence": lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    # per-head norms: dim 1 of the (batch, heads, seq, head_dim) tensor is this rank's heads
    "head_sequence": lambda: SequenceParallel(sequence_dim=1, use_local_output=True),
    # every rank computes the whole module (weights replicated) on the whole input, the output kept a
    # DTensor, so the gradients its split consumers give back are summed over the ranks by DTensor
    "replicate": lambda: _Replicated(),
    # a replicated tensor that this rank's heads alone go on to use: a plain tensor from here on, whose
    # gradient is this rank's part of the sum (latent attention's rotary key)
    "local_partial": lambda: _LocalPartial(),
    # gather_sequence for an attention with per-head parameters of its own (gpt-oss's sinks), which
    # are split by head as the column-parallel q_proj splits the heads
    "gather_sequence_head_params": lambda: _HeadParams(),
    # every rank runs the module whole on the whole sequence (a mixture of experts): see _Whole
    "whole": lambda: _Whole(),
}


class _Replicated(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x = inputs[0]
            x = (x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor)
                 else DTensor.from_local(x, mesh, [Replicate()], run_check=False))
            return (x, *inputs[1:])
        return distribute_module(module, device_mesh, input_fn=replicated)


class _LocalPartial(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def local(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x = inputs[0]
            return (x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x, *inputs[1:])
        return distribute_module(module, device_mesh, input_fn=local)


class _HeadParams(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        STYLES["gather_sequence"]()._apply(module, device_mesh)
        for key, parameter in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, nn.Parameter(distribute_tensor(parameter, device_mesh, [Shard(0)]),
                                                        requires_grad=parameter.requires_grad))
        return module


class _Whole(ParallelStyle):
    """A module every rank computes whole, in plain tensors: the routed MLP, whose sorting, counting
    and grouped matmuls DTensor has no rules for. Its parameters are DTensors replicated over the
    mesh (the optimizer and the gradients' norm then see DTensors only), handed to the module as
    their local tensors for the forward; its input is gathered from the sequence slices and its
    output cut back into this rank's slice. Every rank so computes the same output and, from the
    gathered gradient of it, the same full gradients: nothing is summed over the ranks, and the
    router's statistics count each token once per rank, as the rank's own full copy. Buffers (the
    experts' selection bias) stay plain tensors, the same on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, parameter in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(parameter, mesh, [Replicate()]),
                                                         requires_grad=parameter.requires_grad))

        def enter(mod: nn.Module, inputs: tuple) -> tuple:
            for owner in mod.modules():
                for key, parameter in list(owner._parameters.items()):
                    if isinstance(parameter, DTensor):
                        swapped.append((owner, key, parameter))
                        owner._parameters[key] = parameter.to_local()
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return (x.redistribute(device_mesh, [Replicate()]).to_local(), *inputs[1:])

        def leave(mod: nn.Module, inputs: tuple, output: Any) -> Any:
            while swapped:
                owner, key, parameter = swapped.pop()
                owner._parameters[key] = parameter
            whole = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return whole.redistribute(device_mesh, [Shard(1)]).to_local()

        distribute_module(module, device_mesh, partition_fn=replicate)
        for owner in module.modules():  # (distribute_module replicates the buffers too: plain again)
            for key, buffer in list(owner._buffers.items()):
                if isinstance(buffer, DTensor):
                    owner._buffers[key] = buffer.to_local()
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


def block_plan(block: nn.Module, arch: str) -> dict:
    """The plan for one transformer Block of model.arch=`arch`; names are relative to the block."""
    return {name: STYLES[style]() for name, style in spec_of(arch).tp_plan(block).items()}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> nn.Module:
    """Shard `model` (a GPT or Llama, or a pipeline stage of one) over `tp_mesh` in place.

    `loss_parallel`: leave the logits sharded over the vocabulary as a DTensor; the caller must then
    compute the loss (and run backward) inside `torch.distributed.tensor.parallel.loss_parallel()`.
    Otherwise the logits are gathered and every rank gets the full (batch, seq, vocab) tensor.
    """
    top = {}
    if model.tok_emb is not None:
        # Embedding outputs go straight into the sequence-parallel region: sharded along the sequence.
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.pos_emb is not None:
        # The position table is indexed by position: its output's dim 0 is the sequence.
        top["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if model.tok_emb is None:
        # A later pipeline stage receives full hidden states; cut them along the sequence.
        model.register_forward_pre_hook(_shard_sequence_hook(tp_mesh))
    if model.ln_f is not None:
        top["ln_f"] = SequenceParallel()
    if model.lm_head is not None:
        top["lm_head"] = ColwiseParallel(input_layouts=Shard(1),
                                         output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    elif model.ln_f is None:
        # A middle pipeline stage sends full hidden states on to the next stage.
        model.register_forward_hook(_gather_sequence_hook(tp_mesh))
    if model.vocab_mask is not None and loss_parallel:
        # The mask sees this rank's columns of the vocabulary-sharded logits, ids from first_id on.
        top["vocab_mask"] = PrepareModuleInputOutput(
            input_layouts=Shard(-1), desired_input_layouts=Shard(-1), use_local_input=True,
            output_layouts=Shard(-1), desired_output_layouts=Shard(-1), use_local_output=False)
        model.vocab_mask.first_id = tp_mesh.get_local_rank() * (model.config.vocab_rows // tp_mesh.size())
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block, model.config.arch))
    return model


def _shard_sequence_hook(tp_mesh: DeviceMesh):
    from torch.distributed.tensor import DTensor

    def hook(module: nn.Module, args: tuple):
        (hidden,) = args
        return (DTensor.from_local(hidden, tp_mesh, [Replicate()], run_check=False)
                .redistribute(tp_mesh, [Shard(1)]).to_local(),)
    return hook


def _gather_sequence_hook(tp_mesh: DeviceMesh):
    from torch.distributed.tensor import DTensor

    def hook(module: nn.Module, args: tuple, output: Any):
        return DTensor.from_local(output, tp_mesh, [Shard(1)], run_check=False).full_tensor()
    return hook
