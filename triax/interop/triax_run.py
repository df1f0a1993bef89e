"""Another triax run as a new run starts from it (model.init_from): its newest good snapshot, read
through the layout-independent loader, and its text codec (tokenizer.json or character vocabulary).
The run directory is opened by its own room (triax/runs/reader.py's `as_foreign_run`), which hands
this class what it read; here it answers the one interface every format answers (foreign_run.py)."""

from __future__ import annotations

import torch

from triax import checkpoint
from triax.interop.foreign_run import ForeignRun, StoredName, same_name
from triax.models.config import GPTConfig, architecture_fields
from triax.models.decoder import vocabulary_rows


class TriaxRun(ForeignRun):
    """A triax run directory: `snapshot` its newest good snapshot, `model_config` its checked
    model.json, `codec` its text codec, `description` the transformers files it kept."""

    kind = "run"
    is_triax_run = True

    def __init__(self, path: str, snapshot: str, model_config: GPTConfig, codec: object | None,
                 description: dict[str, str]):
        super().__init__(path, architecture_fields(model_config), codec, description=description)
        self.snapshot = snapshot

    def load_weights(self, model: torch.nn.Module, model_config: GPTConfig,
                     stored_name: StoredName = same_name) -> None:
        # By the real rows of the embedding and head: the run may have padded its vocabulary otherwise.
        checkpoint.load_snapshot(self.snapshot, model, None, restore_rng=False, stored_name=stored_name,
                                 real_rows=vocabulary_rows(model_config))
