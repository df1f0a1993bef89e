"""accelerate.checkpointing's counterpart. Accelerate's checkpoint file writers are not part of
triax: their names import, and using one raises a line naming Accelerator.save_state / load_state,
which write and read triax snapshots (docs/snapshots.md)."""

from triax.accelerate._internal.surface import serve_absent

__all__: list[str] = []

__getattr__, __dir__ = serve_absent(__name__)
