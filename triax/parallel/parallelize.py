"""Build a model (GPT or Llama) in a layout: tensor parallel, activation checkpointing, compile, then data parallel
(FSDP2 / HSDP / DDP) — always in this order (docs/architecture.md) — on each pipeline stage.

Sharded construction: each rank builds only its pipeline stages, on the meta device (no memory),
applies tensor parallelism and FSDP there, and only then allocates its own shards (`to_empty`)
and initialises them. Initial values are a function of (seed, parameter name) and each rank
draws just its slice (triax.models.init), so every layout starts from the single-process weights
and no rank ever holds the whole model unless its layout says so. DDP needs real tensors (it
broadcasts them at wrapping), so replicated layouts materialise before it.

Why this order: FSDP must wrap modules whose parameters are already DTensors sharded by TP (it
then shards them again over the data-parallel mesh: 2-D parameters); checkpointing and compile
act on a block's forward and must sit inside FSDP's per-block all-gather hooks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, TYPE_CHECKING

import torch
import torch.nn as nn

from triax.models import GPTConfig, build_model
from triax.models.lora import apply_lora, init_adapters
from triax.parallel.activation_checkpoint import apply_activation_checkpointing
from triax.parallel.compile import apply_compile
from triax.parallel.mesh import Layout, check_cpu_offload, pipeline_microbatches
from triax.runtime.precision import Precision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from triax.models.lora import LoRAConfig


@dataclass
class ParallelModel:
    """What a rank holds after parallelization."""

    layout: Layout
    mesh: object | None  # the DeviceMesh, None for one process
    parts: list[nn.Module]  # this rank's modules (one; two per rank for interleaved schedules)
    model: nn.Module  # pp == 1: the module to call; pp > 1: a ModuleList of `parts`
    loss_parallel: bool = False  # logits are vocabulary-sharded DTensors (compute the loss in loss_parallel())
    schedule: object | None = None  # the pipeline schedule when pp > 1
    stage_ids: list[int] = field(default_factory=list)
    is_first_stage: bool = True
    is_last_stage: bool = True

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None


def data_parallel_kind(layout: Layout) -> str:
    """none | ddp | fsdp | hsdp. Replication alongside tensor or pipeline parallelism goes through
    FSDP2's HSDP with a shard group of one: DDP does not take the DTensor parameters TP makes, and
    its bucket bookkeeping breaks when a pipeline schedule interleaves micro-batches' forwards and
    backwards (an internal assert in the reducer). Context-parallel ranks shard the parameters too
    (as torchtitan does: FSDP over dp_shard x cp), which also averages their gradients."""
    if layout.dp_shard * layout.cp > 1:
        return "hsdp" if layout.dp_replicate > 1 else "fsdp"
    if layout.dp_replicate > 1:
        return "hsdp" if layout.tp > 1 or layout.pp > 1 else "ddp"
    return "none"


def _materialize(part: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate this rank's part of every parameter (only its shards once sharded) and initialise it."""
    part.to_empty(device=device)
    part.init_weights(seed)
    init_adapters(part, seed)  # LoRA's own initialisation (none without adapters)


def _parallelize_part(part: nn.Module, layout: Layout, mesh: DeviceMesh, precision: Precision, parallel: Any,
                      device: torch.device, loss_parallel: bool, seed: int,
                      lora: LoRAConfig | None = None) -> nn.Module:
    from triax.parallel.ddp import apply_ddp
    from triax.parallel.fsdp import apply_fsdp, sharded_parameter_device
    from triax.parallel.tensor_parallel import apply_tensor_parallel

    if layout.tp > 1:
        apply_tensor_parallel(part, mesh["tp"], loss_parallel=loss_parallel)
    if layout.cp > 1:
        from triax.parallel.context_parallel import apply_context_parallel  # deferred: context-parallel runs only

        apply_context_parallel(part, mesh["cp"])
    if lora is not None and lora.rank:
        # After TP (the adapters are split like the layers TP has split), before checkpointing,
        # compile and FSDP (which act on a block with its adapters).
        apply_lora(part, lora, mesh["tp"] if layout.tp > 1 else None)
    apply_activation_checkpointing(part, parallel.activation_checkpointing)
    if parallel.compile:
        apply_compile(part)
    kind = data_parallel_kind(layout)
    cpu_offload = parallel.cpu_offload
    if layout.ep > 1:  # the experts' own units first: the blocks' FSDP leaves them alone
        from triax.parallel.expert_parallel import apply_expert_parallel, build_expert_mesh  # deferred: MoE runs only

        apply_expert_parallel(part, build_expert_mesh(layout.dp_shard, layout.ep, mesh.device_type), precision)
    if kind in ("fsdp", "hsdp"):
        dp_mesh = _sharding_mesh(mesh, layout, kind)
        apply_fsdp(part, dp_mesh, precision, reshard_after_forward=layout.pp == 1, cpu_offload=cpu_offload)
        _materialize(part, sharded_parameter_device(device, cpu_offload), seed)
        return part
    _materialize(part, device, seed)
    if kind == "ddp":
        return apply_ddp(part, device, process_group=mesh["dp_replicate"].get_group(), bucket_mb=parallel.bucket_mb,
                         grad_compression=parallel.grad_compression, powersgd_rank=parallel.powersgd_rank)
    return part


def _sharding_mesh(mesh: DeviceMesh, layout: Layout, kind: str):
    """FSDP's mesh: dp_shard, with the context-parallel ranks folded in (one flattened dimension,
    so their gradients are reduced together), and dp_replicate before it for HSDP."""
    if layout.cp == 1:
        return mesh["dp_shard"] if kind == "fsdp" else mesh["dp_replicate", "dp_shard"]
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if kind == "fsdp":
        return flat
    with warnings.catch_warnings():  # torch asks to keep the flattened mesh; HSDP needs it beside dp_replicate
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", "dp_shard_cp"]


def parallelize(model_config: GPTConfig, layout: Layout, mesh: DeviceMesh, precision: Precision, parallel: Any,
                device: torch.device, *, seed: int,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, rank: int = 0,
                lora: LoRAConfig | None = None) -> ParallelModel:
    """Build this rank's part of the model of `model_config` in `layout`: cut (pp), shard (tp, fsdp),
    wrap (ddp), with initial weights equal to the single-process `build_model(model_config, seed=seed)`.

    `parallel` is a triax.config.ParallelConfig; `loss_fn(logits, targets)` is needed for pp > 1;
    `lora`: a triax.models.lora.LoRAConfig (rank > 0: the base frozen, adapters added).
    """
    check_cpu_offload(layout, parallel.cpu_offload)
    dtype = precision.param_dtype
    if layout.pp == 1:
        # Vocabulary-parallel loss when TP shards the head (and no pipeline needs plain outputs).
        loss_parallel = layout.tp > 1
        with torch.device("meta"):
            model = build_model(model_config).to(dtype)
        model = _parallelize_part(model, layout, mesh, precision, parallel, device, loss_parallel, seed, lora)
        return ParallelModel(layout, mesh, [model], model, loss_parallel=loss_parallel)

    from triax.parallel.mesh import num_stages
    from triax.parallel.pipeline_parallel import build_schedule, build_stage_modules

    pp_rank = layout.coordinates(rank)["pp"]
    with torch.device("meta"):
        stage_modules = build_stage_modules(model_config, pp_rank, layout.pp, parallel.pp_schedule,
                                            list(parallel.pp_balance) or None)
    wrapped = [(stage_id, _parallelize_part(module.to(dtype), layout, mesh, precision, parallel, device, False, seed,
                                            lora))
               for stage_id, module in stage_modules]
    microbatches = pipeline_microbatches(parallel.pp_microbatches, layout.pp)
    schedule = build_schedule(wrapped, layout.pp, parallel.pp_schedule, microbatches, loss_fn, device,
                              mesh["pp"].get_group())
    stage_ids = [stage_id for stage_id, _ in wrapped]
    parts = [module for _, module in wrapped]
    return ParallelModel(layout, mesh, parts, nn.ModuleList(parts), schedule=schedule, stage_ids=stage_ids,
                         is_first_stage=0 in stage_ids,
                         is_last_stage=num_stages(layout.pp, parallel.pp_schedule) - 1 in stage_ids)
