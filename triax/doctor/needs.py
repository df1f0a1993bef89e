"""What the configured run will need: its model's shape, its layout on this job, and triax plan's
estimates of the memory per device and the bytes of one snapshot.

The figures are `triax plan`'s (triax/parallel/plan.py), computed from the same composed config
`triax train` would run, so the doctor checks the run that is about to start, not a default one.
"""

from __future__ import annotations

from dataclasses import dataclass

from triax.errors import TriaxError
from triax.parallel.mesh import Layout, padded_vocab_size, resolve_layout
from triax.parallel.plan import Estimate, ModelShape, estimate
from triax.config import TrainConfig, gpt_config, snapshot_root


@dataclass
class RunNeeds:
    shape: ModelShape
    layout: Layout
    per_device: Estimate
    snapshot_bytes: int
    """One snapshot of the whole model: its parameters and AdamW's two moments (every rank's shards)."""
    snapshots_kept: int
    """How many snapshots live at once: trainer.keep_last complete ones plus the one being written
    (0 keeps all: counted as the complete ones plus one, the least it can be)."""
    snapshot_dir: str


def run_needs(config: TrainConfig, world_size: int) -> RunNeeds:
    """The run's needs; a TriaxError (the trainer's own words) when the config cannot run at all."""
    trainer, parallel = config.trainer, config.parallel
    vocab_size, block_size, model_keys, data_block_size = _model_sizes(config)
    layout = resolve_layout(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp, world_size, parallel.cp)
    padded = padded_vocab_size(vocab_size, layout.tp)
    model_config = gpt_config(model_keys, vocab_size, block_size, padded if padded != vocab_size else None)
    shape = ModelShape.from_config(model_config, block_size=data_block_size)
    per_device = estimate(shape, layout, batch_size=trainer.batch_size, precision=trainer.precision,
                          checkpointing=parallel.activation_checkpointing, pp_schedule=parallel.pp_schedule,
                          microbatches=parallel.pp_microbatches)
    whole = estimate(shape, Layout(), batch_size=1, precision=trainer.precision)
    snapshot_bytes = int((whole.params_gb + whole.optimizer_gb) * 2**30)
    kept = (trainer.keep_last or 1) + 1
    return RunNeeds(shape, layout, per_device, snapshot_bytes, kept, snapshot_root(config))


def _model_sizes(config: TrainConfig):
    """(vocabulary size, context, model keys, the data's context): the data decides the sizes, as in
    the trainer; a checkpoint to start from (model.init_from) fixes the architecture."""
    from triax.train import init_from  # deferred: reads transformers' files only when asked
    from triax.train.data import build_data  # deferred: the data loaders import tokenizers lazily

    model = config.model
    source = init_from.resolve(model.init_from, model) if model.init_from else None
    data = build_data(config.data, source.codec if source else None)
    if source is None:
        return data.vocab_size, data.block_size, model, data.block_size
    keys = dict(vars(model))
    keys.update({key: value for key, value in source.architecture.items() if key not in ("vocab_size", "block_size")})
    try:
        merged = type(model)(**keys)
    except TypeError as error:
        raise TriaxError(f"model.init_from={model.init_from!r}: {error}") from None
    return source.architecture["vocab_size"], source.architecture["block_size"], merged, data.block_size
