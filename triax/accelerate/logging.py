"""`get_logger`: Python logging that knows which process it runs in (accelerate.logging's counterpart).

    from triax.accelerate.logging import get_logger
    logger = get_logger(__name__)
    logger.info("once, on the main process")
    logger.info("on every process", main_process_only=False)
    logger.info("on every process, rank by rank", in_order=True)

Each record's message starts with "[RANK <process index>] ", as Accelerate's. The process state
must exist first (an Accelerator or a PartialState): until then nobody knows which process is
the main one, so logging through the adapter is a RuntimeError, as in Accelerate.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from triax.accelerate._internal.errors import AcceleratorRuntimeError
from triax.accelerate.state import PartialState

__all__ = ["MultiProcessAdapter", "get_logger", "get_verbosity", "set_verbosity", "set_verbosity_debug",
           "set_verbosity_error", "set_verbosity_info", "set_verbosity_warning"]

# The library logger whose level the verbosity functions set: Accelerate's scripts call
# set_verbosity_* for the "accelerate" namespace, and triax's door logs under the same name so the
# calls reach it.
LIBRARY_LOGGER = "accelerate"


def get_verbosity() -> int:
    """The effective level of the library logger, as an integer (logging.WARNING is 30)."""
    return logging.getLogger(LIBRARY_LOGGER).getEffectiveLevel()


def set_verbosity(verbosity: int | str) -> None:
    """Set the library logger's level (an integer or a level name in any case). Loggers under it without a
    level of their own follow; the root logger and other libraries' loggers are left alone."""
    logging.getLogger(LIBRARY_LOGGER).setLevel(verbosity.upper() if isinstance(verbosity, str) else verbosity)


def set_verbosity_debug() -> None:
    set_verbosity(logging.DEBUG)


def set_verbosity_info() -> None:
    set_verbosity(logging.INFO)


def set_verbosity_warning() -> None:
    set_verbosity(logging.WARNING)


def set_verbosity_error() -> None:
    set_verbosity(logging.ERROR)


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose calls take two more keywords: main_process_only (default True: log on
    the main process only) and in_order (every process logs, one after the other; it wins over
    main_process_only and is a collective, so every process must make the call)."""

    def process(self, msg: str, kwargs: Any):
        msg, kwargs = super().process(msg, kwargs)
        # The record's file and line are the caller's: 1 would name this module's log(); the
        # logging package's own frames (LoggerAdapter.info, ...) are skipped by logging itself.
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any):
        if not PartialState._shared_state.get("_initialized"):
            raise AcceleratorRuntimeError("get_logger's logger needs the process state: create the Accelerator "
                                          "(or call PartialState()) before logging through it")
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        state = PartialState()
        if in_order:
            for index in range(state.num_processes):
                if index == state.process_index:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
        elif not main_process_only or state.is_main_process:
            self.logger.log(level, msg, *args, **kwargs)

    def warning_once(self, *args: Any, **kwargs: Any):
        """logger.warning, but a message already warned (same arguments) is not warned again."""
        key = (args, tuple(sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_warned", set())
        if key in seen:
            return
        seen.add(key)
        kwargs.setdefault("stacklevel", 3)  # the caller of warning_once, not warning_once itself
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The `logging` logger called `name`, wrapped in a MultiProcessAdapter. log_level (default:
    $ACCELERATE_LOG_LEVEL) sets that logger's level and the root logger's, as Accelerate does."""
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
