"""LoRA adapters (Hu et al. 2021), applied from outside the model as the parallelisms are.

A target linear layer y = W x + b gains two small matrices, A (rank x in) and B (out x rank), and
computes y = W x + b + (alpha / rank) * B A dropout(x). W and b stay frozen: only A and B train,
so the optimizer holds state for them alone, and a snapshot holds them alone.

The adapters are children of the linear layer they adapt, named as PEFT names them
(`layers.0.attn.q_proj.lora_A.weight`), and their contribution is added by a forward hook: the
layer keeps its class, its own parameter names (checkpoints and init_from are unchanged) and its
place in every parallel plan. Under tensor parallelism the adapters are split like their layer: a
column-parallel layer (q, k, v, gate, up) gets a replicated A and a B split by output rows, so
each rank adds the delta of the output columns it holds; a row-parallel layer (o, down) gets an A
split by input columns and a replicated B, whose partial sums are reduced like the layer's own;
a layer every rank computes whole (latent attention's latents) gets both replicated.
FSDP then shards them with the rest of their block.

Initialisation as PEFT's: A Kaiming-uniform (uniform on +-1/sqrt(in), PEFT's `init_lora_weights=
True`), B zero, so the adapted model starts exactly as the base. A's values are a function of
(seed, parameter name) like every other triax parameter (triax.models.init), so every layout
starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Mapping, TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from triax.errors import ConfigError
from triax.models.family import lora_layers, spec_of
from triax.models.init import init_constant, init_normal, local_box
# The settings and names, in a module of their own that the config reads without torch.distributed.
from triax.models.lora_config import LoRAConfig, is_adapter, model_target_keys

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

class LoRAFactor(nn.Module):
    """One adapter matrix, as a module with a `weight` so its name reads as PEFT's (lora_A.weight).
    Not an nn.Linear: the model's own initialisation (N(0, 0.02) for linear layers) must not touch it."""

    matmul_weight = True  # weight decay applies to it as to a Linear's weight (triax.train.optim)

    def __init__(self, rows: int, columns: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, columns))


class _Switch:
    off = False  # adapters_disabled(): every layer computes its base output alone


_ADAPTERS = _Switch()


@contextlib.contextmanager
def adapters_disabled():
    """Within: every adapted layer is its base layer (PEFT's disable_adapter), the reference
    model of DPO with LoRA without a second model in memory."""
    was, _ADAPTERS.off = _ADAPTERS.off, True
    try:
        yield
    finally:
        _ADAPTERS.off = was


def _add_adapter(module: nn.Linear, args: tuple, output: torch.Tensor):
    if _ADAPTERS.off:
        return output
    x = args[0]
    delta = F.linear(F.linear(module.lora_dropout(x), module.lora_A.weight), module.lora_B.weight)
    delta = delta * module.lora_scaling
    if isinstance(delta, DTensor) and not isinstance(output, DTensor):
        # Tensor parallel: the layer's own output is already a local tensor. A row-parallel
        # layer's delta is a partial sum: reduced and split along the sequence like the layer's.
        # (A replicated layer's output stays a DTensor, and its delta with it.)
        if any(placement.is_partial() for placement in delta.placements):
            delta = delta.redistribute(delta.device_mesh, [Shard(1)])
        delta = delta.to_local()
    return output + delta


def apply_lora(model: nn.Module, config: LoRAConfig, tp_mesh: DeviceMesh | None = None) -> list[str]:
    """Freeze every parameter of `model` (a Decoder or a pipeline stage of one, plain or after
    tensor parallelism) and add adapters to the target layers of each block, on the model's device
    (meta, before materialising). Returns the adapted layers' names."""
    available = lora_layers(model.config)  # the family's: short name -> layer in a block
    keys = model_target_keys(config.targets, model.config)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    # Snapshots of this model hold its adapters alone (triax.checkpoint.snapshot): the frozen base
    # comes back from model.init_from (or the seed) at every start.
    model.snapshot_trainable_only = True
    adapted = []
    for number, block in model.layers.items():
        plan = spec_of(model.config.arch).tp_plan(block) if tp_mesh is not None else {}
        for key in keys:
            path = available[key]
            layer = _target_layer(block, path)
            weight = layer.weight
            device = weight.device if not hasattr(weight, "to_local") else weight.to_local().device
            with torch.device(device):
                layer.lora_A = LoRAFactor(config.rank, layer.in_features)
                layer.lora_B = LoRAFactor(layer.out_features, config.rank)
            if tp_mesh is not None:
                _split_like_layer(layer, tp_mesh, _split_style(plan, path))
            layer.lora_dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
            layer.lora_scaling = config.alpha / config.rank
            layer.register_forward_hook(_add_adapter)
            adapted.append(f"layers.{number}.{path}")
    return adapted


def _target_layer(block: nn.Module, path: str) -> nn.Linear:
    """The linear layer at `path` in the block; one line if the block has none."""
    try:
        layer = block.get_submodule(path)
    except AttributeError:
        layer = None
    if not isinstance(layer, nn.Linear):
        raise ConfigError(f"model.lora.targets names {path} but this model's blocks have no {path} (GPT-2's MLP has "
                          "no gate; a mixture of experts' routed MLP holds batched experts, not these layers); choose "
                          "among the layers it has")
    return layer


# (A's placement, B's) under tensor parallelism, by the style of the layer they adapt: a column-parallel
# layer's B split by output rows, a row-parallel layer's A by input columns, a replicated layer's
# (latent attention's latents, computed whole on every rank as DTensors) both replicated, their
# gradients summed over the ranks by DTensor as the layer's own are.
PLACEMENTS = {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(1), Replicate()),
              "replicate": (Replicate(), Replicate())}


def _split_style(plan: Mapping[str, str], path: str) -> str:
    """The tensor-parallel style of the layer at `path`, one the adapters can follow (PLACEMENTS)."""
    style = plan.get(path)
    if style not in PLACEMENTS:
        raise ConfigError(f"model.lora.targets adapts {path}, which tensor parallelism computes as "
                          f"{style or 'a part of a module run whole on every rank'}; LoRA under parallel.tp adapts "
                          "split or replicated layers only: drop that target or parallel.tp")
    return style


def _split_like_layer(layer: nn.Linear, tp_mesh: DeviceMesh | None, style: str) -> None:
    a_placement, b_placement = PLACEMENTS[style]
    for factor, placement in ((layer.lora_A, a_placement), (layer.lora_B, b_placement)):
        factor.weight = nn.Parameter(distribute_tensor(factor.weight.data, tp_mesh, [placement]))


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, stored_name: Callable[[str], str] = lambda name: name) -> int:
    """PEFT's initialisation of every adapter of `model` (this rank's part): A uniform on
    +-1/sqrt(in) (kaiming_uniform_ with a=sqrt(5)), B zero. Returns how many adapters."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not hasattr(module, "lora_A"):
            continue
        name = stored_name(name)
        bound = 1.0 / math.sqrt(module.in_features)
        # A layout-independent uniform draw: the normal draw of triax.models.init (a function of
        # seed and name alone) through the normal's CDF is uniform on (0, 1).
        weight = module.lora_A.weight
        init_normal(weight, seed, f"{name}.lora_A.weight", 1.0)
        local, _, _ = local_box(weight)
        local.copy_((torch.special.ndtr(local.double()) * 2 - 1).mul(bound).to(local.dtype))
        init_constant(module.lora_B.weight, 0.0)
        count += 1
    return count


def adapter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if is_adapter(name)]


def trainable_summary(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters) of this rank's model, tied weights once."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique if p.requires_grad), sum(p.numel() for p in unique)
