"""Yes/no flags from the environment, read as Accelerate reads them (str_to_bool's words).

Their own module, below triax.accelerate.state, which reads Accelerate's flags when the process
state is made (utils/environment.py, which re-exports these, needs the state)."""

from __future__ import annotations

import os

from triax.accelerate._internal.errors import AcceleratorValueError
from triax.launch.variables import FALSE_WORDS as _FALSE, TRUE_WORDS as _TRUE, check_environment


def str_to_bool(value: str, to_bool: bool = False):
    """'yes'/'true'/'on'/'1'/... -> 1 and 'no'/'false'/'off'/'0'/... -> 0 (True/False with to_bool)."""
    lowered = value.lower()
    if lowered in _TRUE:
        return True if to_bool else 1
    if lowered in _FALSE:
        return False if to_bool else 0
    raise AcceleratorValueError(f"invalid truth value {value!r}; use one of {', '.join(_TRUE + _FALSE)}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The environment variable `key` read as a yes/no flag (str_to_bool), `default` if unset."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def check_accelerate_environment() -> None:
    """Every FSDP_* / ACCELERATE_* variable this process has, checked as `triax launch` checks
    them (triax.launch.variables): at an Accelerator's, a PartialState's or an FSDP plugin's start,
    a bad one is one line naming it, as Accelerate's ValueError."""
    check_environment(os.environ, AcceleratorValueError)
