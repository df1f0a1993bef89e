"""DPO for `triax train`: its pairs read from data.path, and the objective built from the run."""

from __future__ import annotations

from typing import Any

from triax.data.tokenizer import require_checkpoint_tokenizer
from triax.objectives import RunParts
from triax.objectives.chunked_logits import logits_limit_mb
from triax.objectives.dpo.objective import DPOObjective


def load_pairs(config: Any, codec: Any, source: Any, run: Any = None) -> tuple[Any, Any, str]:
    """(training pairs, validation pairs, the log's report) of the DataConfig `config`, encoded as
    TRL's DPOTrainer encodes them (triax.data.preference) by model.init_from's tokenizer `codec`."""
    from triax.data.preference import load_preference_datasets, preference_encoder_for  # deferred: a DPO run's only

    require_checkpoint_tokenizer("preference", codec, source, "its tokenizer and chat template encode the pairs")
    encoder = preference_encoder_for(config.chat_template, source.description, source.path, codec.tokenizer)
    pairs = load_preference_datasets(config.path, config.val_path, config.train_split, encoder, config.block_size,
                                     config.truncation_mode)
    return pairs.train, pairs.val, pairs.report


def build(parts: RunParts) -> DPOObjective:
    """The objective of the run: its evaluation scores the plain policy over the validation pairs,
    trainer.eval_batches batches of trainer.batch_size pairs per data-parallel rank (0: all)."""
    config = parts.config
    objective = DPOObjective(config.dpo, logits_limit_mb(config.parallel.max_logits_mb, parts.device))
    objective.model, objective.validation = parts.model, parts.data.val
    objective.batch_size = config.trainer.batch_size
    objective.eval_limit = config.trainer.eval_batches * config.trainer.batch_size * parts.data_parallel_size
    return objective
