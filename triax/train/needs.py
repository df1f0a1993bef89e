"""What the configured run will need (triax.doctor.needs), with the model's sizes found as the
trainer finds them: the data decides them; a checkpoint to start from (model.init_from) fixes the
architecture. `triax doctor` and a run's `trainer.preflight` hand `run_needs` to the doctor's checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triax.config import TrainConfig
from triax.doctor.needs import ModelSizes, RunNeeds, needs_of
from triax.errors import TriaxError

if TYPE_CHECKING:  # the type only: the doctor's sizes read a checkpoint only when asked
    from triax.interop.foreign_run import ForeignRun


def run_needs(config: TrainConfig, world_size: int, source: ForeignRun | None = None,
              device: torch.device | None = None) -> RunNeeds:
    """The run's needs; a TriaxError (the trainer's own words) when the config cannot run at all.
    `source`: model.init_from's checkpoint, if the run has it open already; `device`: where the run
    computes (None: a CPU), which decides the loss's logits limit when parallel.max_logits_mb is unset."""
    # deferred: the objectives import torch.distributed's tensor package, which `triax doctor --help` must not load
    from triax.objectives.chunked_logits import logits_limit_mb

    limit = logits_limit_mb(config.parallel.max_logits_mb, device if device is not None else torch.device("cpu"))
    return needs_of(config, world_size, model_sizes(config, source), limit)


def model_sizes(config: TrainConfig, source: ForeignRun | None = None) -> ModelSizes:
    """The sizes the trainer would build the model with, from the data and model.init_from
    (`source`: that checkpoint, if it is open already)."""
    from triax.train import init_from  # deferred: reads transformers' files only when asked
    from triax.train.data import build_data  # deferred: the data loaders import tokenizers lazily

    model = config.model
    if source is None and model.init_from:
        source = init_from.resolve(model.init_from, model)
    data = build_data(config.data, source.codec if source else None)
    if source is None:
        return ModelSizes(data.vocab_size, data.block_size, model, data.block_size)
    keys = dict(vars(model))
    keys.update({key: value for key, value in source.architecture.items() if key not in ("vocab_size", "block_size")})
    try:
        merged = type(model)(**keys)
    except TypeError as error:
        raise TriaxError(f"model.init_from={model.init_from!r}: {error}") from None
    return ModelSizes(source.architecture["vocab_size"], source.architecture["block_size"], merged, data.block_size)
