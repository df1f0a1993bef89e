"""`triax train`'s room: the Trainer and its components.

The Trainer is imported when asked for (PEP 562): a command that needs one piece of this room
(`triax doctor`'s run needs) does not load the whole trainer and what it imports (torch's
checkpoint, tensor and pipeline packages, a second of start-up). What reads a finished run
(generate, eval, export) is triax/runs/, apart from the loop."""

from typing import TYPE_CHECKING

from triax.config import TrainConfig, compose_config

if TYPE_CHECKING:  # for readers of the code and the API pages (mkdocstrings); at run time: __getattr__
    from triax.train.trainer import Trainer

__all__ = ["TrainConfig", "Trainer", "compose_config"]


def __getattr__(name: str) -> object:
    if name == "Trainer":
        from triax.train.trainer import Trainer  # deferred: start-up time (see the docstring)

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
