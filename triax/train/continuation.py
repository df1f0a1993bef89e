"""`trainer.continue_from`: a run another tool began, continued by the trainer from the step that
tool would take next. The checkpoint's own reader (triax/interop/foreign_run.py's interface:
nanoGPT's ckpt.pt in triax/interop/nanogpt/run.py, a transformers Trainer's checkpoint-N in
triax/interop/hf_trainer/run.py) checks and loads its state. Its settings reached the config when
it was composed (config/compose.py's continuation_overrides); its weights are loaded as
model.init_from's.
"""

from __future__ import annotations

import torch

from triax import checkpoint
from triax.errors import ConfigError
from triax.interop.foreign_run import ForeignRun, StoredName
from triax.models.config import GPTConfig
from triax.config import TrainConfig, final_lr
from triax.train.optim import warmup_cosine


def check(source: ForeignRun, config: TrainConfig) -> None:
    """The saved optimizer state (and a Trainer's schedule), checked before any process group or
    run directory exists; one ConfigError line if it cannot be continued."""
    optim = config.optim

    def rate_at(step: int) -> float:  # the continued run's learning rate at `step`
        return warmup_cosine(step, optim.decay_steps or config.trainer.max_steps or step, optim.warmup_steps,
                             optim.lr, final_lr(optim), optim.schedule)

    try:
        source.check_continuation(optim, rate_at)
    except checkpoint.SnapshotError as error:
        raise ConfigError(f"trainer.continue_from: {error}") from None


def load(source: ForeignRun, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_config: GPTConfig,
         stored_name: StoredName) -> tuple[int, tuple[float, int] | None]:
    """Put the saved AdamW state into this rank's `optimizer` (its state must exist); returns (the
    step to continue from, the best validation (loss, step) so far, or None)."""
    source.load_optimizer_state(model, optimizer, model_config, stored_name)
    return source.step, source.best
