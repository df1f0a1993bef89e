"""What the configured run will need: its model's shape, its layout on this job, and triax plan's
estimates of the memory per device and the bytes of one snapshot.

The figures are `triax plan`'s (triax/parallel/plan.py), computed from the same composed config
`triax train` would run, so the doctor checks the run that is about to start, not a default one.
The model's sizes are the trainer's to find (the data decides them, a checkpoint in model.init_from
fixes the architecture): triax.train.needs reads them and hands them here as plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from triax.config import ModelConfig, TrainConfig, gpt_config, snapshot_root
from triax.parallel.mesh import Layout, padded_vocab_size, resolve_layout
from triax.parallel.plan import Estimate, ModelShape, estimate


class ModelSizes(NamedTuple):
    """The sizes the trainer would build the model with."""

    vocab_size: int
    block_size: int
    """The model's context."""
    model: ModelConfig
    """The model keys: model.* with a checkpoint's architecture (model.init_from) merged in."""
    data_block_size: int
    """The data's context: the sequences a step trains on."""


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


def needs_of(config: TrainConfig, world_size: int, sizes: ModelSizes, max_logits_mb: float = 0.0) -> RunNeeds:
    """The run's needs, from its config and the model's sizes; `max_logits_mb`: the limit on the
    loss's logits as the run applies it on its device (0: whole logits at any size)."""
    trainer, parallel = config.trainer, config.parallel
    layout = resolve_layout(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp, world_size, parallel.cp,
                            parallel.ep)
    padded = padded_vocab_size(sizes.vocab_size, layout.tp)
    model_config = gpt_config(sizes.model, sizes.vocab_size, sizes.block_size,
                              padded if padded != sizes.vocab_size else None)
    shape = ModelShape.from_config(model_config, block_size=sizes.data_block_size)
    per_device = estimate(shape, layout, batch_size=trainer.batch_size, precision=trainer.precision,
                          checkpointing=parallel.activation_checkpointing, pp_schedule=parallel.pp_schedule,
                          microbatches=parallel.pp_microbatches, max_logits_mb=max_logits_mb)
    whole = estimate(shape, Layout(), batch_size=1, precision=trainer.precision)
    snapshot_bytes = int((whole.params_gb + whole.optimizer_gb) * 2**30)
    kept = (trainer.keep_last or 1) + 1
    return RunNeeds(shape, layout, per_device, snapshot_bytes, kept, snapshot_root(config))
