"""What the configured run will need (triax.doctor.needs), with the model's sizes found as the
trainer finds them: the data decides them; a checkpoint to start from (model.init_from) fixes the
architecture. `triax doctor` and a run's `trainer.preflight` hand `run_needs` to the doctor's checks.
"""

from __future__ import annotations

from triax.config import TrainConfig
from triax.doctor.needs import ModelSizes, RunNeeds, needs_of
from triax.errors import TriaxError


def run_needs(config: TrainConfig, world_size: int) -> RunNeeds:
    """The run's needs; a TriaxError (the trainer's own words) when the config cannot run at all."""
    return needs_of(config, world_size, model_sizes(config))


def model_sizes(config: TrainConfig) -> ModelSizes:
    """The sizes the trainer would build the model with, from the data and model.init_from."""
    from triax.train import init_from  # deferred: reads transformers' files only when asked
    from triax.train.data import build_data  # deferred: the data loaders import tokenizers lazily

    model = config.model
    source = init_from.resolve(model.init_from, model) if model.init_from else None
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
