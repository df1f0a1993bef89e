"""A batch larger than the training data is lowered to fit, with a line saying so.

A first chat run on one's own 20 conversations would otherwise be refused with the default batch
of 32 (one step must fit in the training set: the epoch is the sampler's unit). The largest batch
whose step fits is what the user asked for as nearly as the data allows; nothing else changes, so
a restart on the same data lowers it the same way and resumes exactly.
"""

from __future__ import annotations

from triax.errors import ConfigError


def fit_batch_size(batch_size: int, samples: int, data_parallel: int, grad_accum: int) -> tuple[int, str | None]:
    """(the per-rank batch to train with, the line that says it was lowered, or None)."""
    per_step = batch_size * data_parallel * grad_accum
    if samples >= per_step:
        return batch_size, None
    fitted = samples // (data_parallel * grad_accum)
    if fitted < 1:
        raise ConfigError(
            f"one step needs at least {data_parallel * grad_accum} samples (1 per data-parallel rank x "
            f"{data_parallel} ranks x grad_accum {grad_accum}) but the training set has {samples}; "
            "give more data, or lower grad_accum or the number of processes")
    return fitted, (f"trainer.batch_size {batch_size} lowered to {fitted}: the training set has {samples} "
                    f"samples and one step needs batch_size x {data_parallel} data-parallel rank(s) x grad_accum "
                    f"{grad_accum} of them (set trainer.batch_size to choose)")
