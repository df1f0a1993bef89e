"""What a run saved by another tool (or by triax itself) gives a new run, whatever its format: the one
interface every format's room implements, so that `model.init_from`, `trainer.continue_from`, eval
and export ask the source, never a `kind` string, what it holds.

- `architecture`: the GPTConfig fields the checkpoint fixes (every model.* key but dropout);
- `codec`: the text codec it carries (a BPETokenizer or a character Vocabulary), or None;
- `load_weights`: this rank's part of a freshly built model, read by triax name and slice (each
  format's reader copies only what this process holds: never the whole model in one process);
- `whole_model`: the whole plain model on one device, for the commands that score or answer with
  it (`triax eval`, `triax generate --chat`; a triax run and a transformers directory give one);
- for the formats a run can be continued from (`can_continue`: nanoGPT's ckpt.pt, a transformers
  Trainer's checkpoint-N): `overrides` (the schedule and optimizer settings as triax keys),
  `saved_state` (AdamW's moments by the tool's parameter names and its step count; None where the
  format saves no optimizer), `load_optimizer_state`, `step` and `best`.

As torchtitan keeps every Hugging Face conversion behind one state-dict adapter per model and
torchtune every format behind one checkpointer, the rooms of triax/interop/ keep theirs behind this.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from triax.models.config import GPTConfig

# The name a stored tensor has in the checkpoint for a parameter name of the model being loaded
# (the model may be wrapped: FSDP's or activation checkpointing's prefixes are taken off).
StoredName = Callable[[str], str]
# The text codec of a tokenizer.json file (the training room's BPETokenizer, given by the caller:
# the wing reads other tools' files and builds no part of a run).
CodecOf = Callable[[str], object]



class ScheduleSettings(Protocol):
    """The run's optim.* settings a continuation is checked against (the training config's optim)."""

    schedule: str
    lr: float
    warmup_steps: int
    decay_steps: int
    min_lr: float


def same_name(name: str) -> str:
    return name


class ForeignRun:
    """A checkpoint a run starts from (model.init_from) or continues (trainer.continue_from)."""

    kind = ""  # the format's name ("transformers", "run", "nanogpt", "meta", "torchtitan"), for reports
    tool_name = ""  # whose run it is, in messages: "nanoGPT's", "transformers Trainer's"
    is_triax_run = False  # a triax run directory (its snapshots, read through the layout-independent loader)
    can_continue = False  # carries the optimizer state and step trainer.continue_from needs

    def __init__(self, path: str, architecture: dict, codec: object | None, context_reason: str = "",
                 description: dict | None = None):
        self.path = path
        self.architecture = architecture  # GPTConfig fields the checkpoint fixes
        self.codec = codec  # encodes text for the run: a BPETokenizer or a character Vocabulary
        # why the context is what it is, when not the checkpoint's max positions
        self.context_reason = context_reason
        # {name: path} of the transformers files describing the checkpoint besides its weights (config,
        # generation config, tokenizer files), which the run keeps a copy of
        # (triax/runs/directory.py's keep_description)
        self.description = description or {}

    def load_weights(self, model: torch.nn.Module, model_config: GPTConfig, stored_name: StoredName = same_name) -> None:
        """Overwrite this rank's part of the freshly built `model` with the checkpoint's values."""
        raise NotImplementedError

    def whole_model(self, device: torch.device) -> torch.nn.Module:
        """The whole plain model, in eval mode, on `device` (checked to fit there before it is read)."""
        raise NotImplementedError(f"{self.path}: a {self.kind} checkpoint is not read as a whole model")

    # ---- continuing the run (trainer.continue_from) ---------------------------------------------

    def overrides(self, data_parallel: int) -> tuple[list[str], list[str]]:
        """(triax `key=value` overrides that continue the run as its tool would, notes on what could
        not be carried over). `data_parallel`: the new run's data-parallel processes."""
        raise NotImplementedError(f"{self.path}: a {self.kind} checkpoint cannot be continued")

    def saved_state(self) -> tuple[dict[str, dict], float] | None:
        """({the tool's parameter name: {"exp_avg": tensor, "exp_avg_sq": tensor}}, AdamW's step
        count), checked against the model's shapes; None where the format holds no optimizer state."""
        return None

    def check_continuation(self, optim: ScheduleSettings, rate_at: Callable[[int], float]) -> None:
        """The saved state (and schedule) can be continued under the run's `optim` settings, whose
        learning rate at a step is `rate_at(step)`; raises SnapshotError if not."""
        raise NotImplementedError(f"{self.path}: a {self.kind} checkpoint cannot be continued")

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_config: GPTConfig,
                             stored_name: StoredName = same_name) -> int:
        """Put the saved AdamW moments and step count into this rank's `optimizer` over `model` (its
        state must exist); returns the number of values read."""
        raise NotImplementedError(f"{self.path}: a {self.kind} checkpoint cannot be continued")

    @property
    def step(self) -> int:
        """The step the continued run takes next."""
        raise NotImplementedError

    @property
    def best(self) -> tuple[float, int] | None:
        """The best validation (loss, step) so far, or None."""
        return None
