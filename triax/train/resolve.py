"""The configuration a run trains with, resolved from the one it is given: the architecture from
the checkpoint it starts from (model.init_from or trainer.continue_from), the batch fitted to the
data, the local paths made absolute. triax.train.prepare's `prepare_run` runs these steps, in
their order, on the run's own copy of the config (`working_copy`) before any process group exists
and hands the result to the Trainer, which trains it as it is; the config given is never edited,
and each checkpoint is opened once: trainer.continue_from's run as the composition opened it
(config/compose.py's compose_run), handed on.
"""

from __future__ import annotations

import copy
import sys

from triax.config.compose import absolute_paths
from triax.config.schema import TrainConfig
from triax.train.data import TrainData
from triax.errors import ConfigError, printable
from triax.interop.foreign_run import ForeignRun
from triax.models.config import DEFAULT_ARCH
from triax.parallel.mesh import Layout
from triax.train import continuation, init_from
from triax.train.batch_fit import fit_batch_size


def working_copy(config: TrainConfig) -> TrainConfig:
    """The copy the resolution fills in: the caller's config stays as it was composed."""
    return copy.deepcopy(config)


def open_source(config: TrainConfig, continued: ForeignRun | None = None) -> ForeignRun | None:
    """model.init_from (or trainer.continue_from), resolved and checked before any process group
    exists; `continued`: trainer.continue_from's run as the config's composition opened it."""
    path = config.model.init_from or config.trainer.continue_from
    if not path:
        return None
    source = init_from.resolve(path, config.model, continued if config.trainer.continue_from else None)
    if config.trainer.continue_from:
        continuation.check(source, config)
    if source.codec is None and config.data.task == "char":
        family = source.architecture.get("arch", DEFAULT_ARCH)
        # A GPT-2 checkpoint's tokenizer is GPT-2's own (the tokenizer's name, not the family's).
        tokenizer = ("GPT-2's tokenizer.json" if family == "gpt2" else
                     f"the {family} model's own tokenizer.json (its tokenizer's save_pretrained writes it)")
        raise ConfigError(f"model.init_from={path!r} has no tokenizer.json, so text cannot be encoded for it; "
                          f"put {tokenizer} there, or train on token files (data.task=tokens)")
    if source.is_triax_run and config.model.lora.rank:
        # A LoRA run's snapshots hold only trainable tensors: a triax run's base would not load.
        raise ConfigError(f"model.lora with model.init_from={path!r} (a triax run) is not supported; export the "
                          "run with `triax export RUN OUT --format hf` and start from OUT")
    return source


def take_architecture(config: TrainConfig, source: ForeignRun, changed_shape: dict, data: TrainData,
                      layout: Layout, is_main: bool) -> None:
    """The checkpoint's shape replaces model.* (dropout stays this run's choice)."""
    model = config.model
    init_from.check_fits(source, data.vocab_size, data.block_size)
    # The config is otherwise strict: a shape key given beside model.init_from is not dropped silently.
    ignored = [key for key, value in changed_shape.items()
               if key in source.architecture and source.architecture[key] != value]
    if ignored and is_main:
        given = ", ".join(f"model.{key}={changed_shape[key]}" for key in ignored)
        taken = ", ".join(f"{key}={source.architecture[key]}" for key in ignored)
        print(f"triax: warning: {given} ignored: model.init_from={printable(source.path)!r} decides the model's "
              f"shape ({taken}); leave the shape keys out beside model.init_from", file=sys.stderr, flush=True)
    for key, value in source.architecture.items():
        if key not in ("vocab_size", "block_size"):  # the data's sizes, checked above
            setattr(model, key, value)
    if model.tie_embeddings and (layout.tp > 1 or layout.pp > 1):
        # Tensor and pipeline parallelism need an untied head: it starts as a copy of the
        # embedding (the same logits), and the two then train apart.
        model.tie_embeddings = False
        source.architecture = dict(source.architecture, tie_embeddings=False)
        if is_main:
            print(f"triax: warning: model.init_from={printable(source.path)!r} ties the head to the embedding; with tensor or pipeline "
                  "parallelism they are untied (the head starts as a copy) and train separately",
                  file=sys.stderr, flush=True)


def fit_batch(config: TrainConfig, samples: int, data_parallel: int) -> str | None:
    """trainer.batch_size lowered to fit a training set of `samples` (triax.train.batch_fit: why);
    returns the line that says so, or None."""
    trainer = config.trainer
    trainer.batch_size, note = fit_batch_size(trainer.batch_size, samples, data_parallel, trainer.grad_accum)
    return note


def absolute(config: TrainConfig) -> None:
    """The local paths absolute (config/compose.py's absolute_paths), once every check has named
    them as typed: config.yaml then serves `triax eval`, `generate` and a resume from any directory."""
    absolute_paths(config)
