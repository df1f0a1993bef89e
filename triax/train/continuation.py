"""`trainer.continue_from`: a run another tool began, continued by the trainer from the step that
tool would take next. The checkpoint's kind picks the reader: nanoGPT's ckpt.pt
(triax/interop/nanogpt/run.py) or a transformers Trainer's checkpoint-N
(triax/interop/hf_trainer/run.py). Its settings reached the config when it was composed
(train/config.py's continuation_overrides); its weights are loaded as model.init_from's.
"""

from __future__ import annotations

import math

from triax import checkpoint
from triax.interop.hf_trainer import run as hf_trainer_run
from triax.interop.nanogpt import run as nanogpt_run
from triax.errors import ConfigError
from triax.train.optim import warmup_cosine
from triax.train.config import TrainConfig, final_lr

TOOLS = {"nanogpt": "nanoGPT's", "transformers": "transformers Trainer's"}


def check(source, config: TrainConfig) -> None:
    """The saved optimizer state (and a Trainer's schedule), checked before any process group or
    run directory exists; one ConfigError line if it cannot be continued."""
    try:
        if source.kind == "nanogpt":
            nanogpt_run.saved_state(source.nanogpt)
            return
        source.trainer = hf_trainer_run.open_checkpoint(config.trainer.continue_from)
        hf_trainer_run.saved_state(source.trainer)
        optim, step = config.optim, source.trainer.global_step
        rate = warmup_cosine(step, optim.decay_steps or config.trainer.max_steps or step, optim.warmup_steps,
                             optim.lr, final_lr(optim), optim.schedule)
        hf_trainer_run.check_next_rate(source.trainer, rate, optim)
    except checkpoint.SnapshotError as error:
        raise ConfigError(f"trainer.continue_from: {error}") from None


# nanoGPT's train.py starts best_val_loss at 1e9 and keeps it until its first evaluation (so does
# triax's export, which carries no evaluation over): not a loss to report or to beat.
NANOGPT_UNSET_LOSS = 1e9


def nanogpt_best(loss, iter_num: int) -> tuple[float, int] | None:
    """A nanoGPT checkpoint's best validation (loss, step), or None where it has none yet."""
    if loss is None or not math.isfinite(float(loss)) or float(loss) >= NANOGPT_UNSET_LOSS:
        return None
    return float(loss), iter_num


def load(source, model, optimizer, model_config, stored_name) -> tuple[int, tuple[float, int] | None]:
    """Put the saved AdamW state into this rank's `optimizer` (its state must exist); returns (the
    step to continue from, the best validation (loss, step) so far, or None)."""
    if source.kind == "nanogpt":
        saved = source.nanogpt
        nanogpt_run.load_optimizer_state(saved, model, optimizer, model_config.vocab_size, stored_name)
        return saved.iter_num, nanogpt_best(saved.best_val_loss, saved.iter_num)
    saved = source.trainer
    hf_trainer_run.load_optimizer_state(saved, model, optimizer, model_config, stored_name)
    # This process keeps only its slices of the moments, now in its optimizer: the rest goes.
    source.trainer = None
    hf_trainer_run.release()
    return saved.global_step, saved.best_loss
