"""Pipeline parallelism by `torch.distributed.pipelining`: the layer stack cut into stages.

A rank builds only its own stages (on the meta device; triax.parallel.parallelize materialises
and initialises them): its layers, plus the embeddings on the first stage and the final LayerNorm
and head on the last. Layers live in a ModuleDict, so a layer keeps its name ("layers.5") and a
stage's state dict is a subset of the full model's; initial weights are a function of the seed
and the parameter name, so they equal the single-process model's.

Schedules: gpipe (all forwards, then all backwards), 1f1b (one forward one backward in steady
state: at most pp micro-batches of activations alive), interleaved_1f1b and zero_bubble (two
stages per rank, looped: stage r and r + pp; zero_bubble also splits each backward into input-
and weight-gradient parts to fill the bubble).
"""

from __future__ import annotations

from typing import Callable, TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from triax.models import Decoder, GPTConfig, build_model
from triax.parallel.mesh import num_stages
from triax.parallel.stage_split import split_layers

if TYPE_CHECKING:
    import torch.distributed as dist

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


def stage_ids_for_rank(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """Looped placement: rank r runs stages r, r + pp, ..."""
    return list(range(pp_rank, num_stages(pp, schedule), pp))


def build_stage_modules(config: GPTConfig | Decoder, pp_rank: int, pp: int, schedule: str,
                        balance: list[int] | None = None, seed: int | None = None) -> list[tuple[int, nn.Module]]:
    """(stage index, module) for each stage this rank runs; each module is a model holding only its
    stage's parts. From a config, they are built wherever torch's default device points (the meta
    device, for sharded construction: nothing is allocated until the layout is applied). From an
    existing model, each stage is a new module holding copies of that model's stage weights."""
    source = config if isinstance(config, nn.Module) else None
    config = source.config if source is not None else config
    total = num_stages(pp, schedule)
    ranges = split_layers(config.n_layer, total, balance)
    stages = []
    for stage_id in stage_ids_for_rank(pp_rank, pp, schedule):
        parts = dict(layers=ranges[stage_id], embeddings=stage_id == 0, head=stage_id == total - 1)
        if source is None:
            stages.append((stage_id, build_model(config, seed=seed, **parts)))
            continue
        reference = next(source.parameters())
        with torch.device("meta"):
            stage = build_model(config, **parts).to(reference.dtype)
        weights = source.state_dict()
        stage.to_empty(device=reference.device)
        stage.load_state_dict({name: weights[name] for name in stage.state_dict()})
        stages.append((stage_id, stage))
    return stages


def build_schedule(stage_modules: list[tuple[int, nn.Module]], pp: int, schedule: str, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                   pp_group: dist.ProcessGroup):
    """The pipeline schedule over this rank's stages; `stage_modules` may already be wrapped
    (FSDP, DDP, compiled blocks) — PipelineStage knows to delay their gradient sync."""
    total = num_stages(pp, schedule)
    stages = [PipelineStage(module, stage_id, total, device, group=pp_group)
              for stage_id, module in stage_modules]
    cls = SCHEDULES[schedule]
    if len(stages) == 1:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
