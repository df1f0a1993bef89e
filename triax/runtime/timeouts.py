"""How long a collective may wait: the one home of the collective timeout and its defaults.

Two clocks bound a collective. The watchdog (watchdog.py) allows each step phase the collective
timeout and reports the rank the job waits for; the process group's own timeout (gloo, NCCL) is
the backstop that fails a collective the watchdog is not watching. Set by the user, one number
serves both: `trainer.collective_timeout`, $TRIAX_COLLECTIVE_TIMEOUT (`triax launch
--collective-timeout`) or Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS.

This module imports nothing of triax but its errors, so every layer can read it.
"""

from __future__ import annotations

import os

from triax.errors import TriaxError

ENV_COLLECTIVE_TIMEOUT = "TRIAX_COLLECTIVE_TIMEOUT"
# A step's collectives finish in well under a second on a healthy job; two minutes covers data
# loader stalls, a slow filesystem read and a straggling host many times over, yet a hang costs
# two minutes instead of the process group's ten. Slow phases get SLOW_PHASE_FACTOR times more.
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
SLOW_PHASE_FACTOR = 5
# Unset, the process group waits as long as the watchdog's slowest phase (10 minutes), so in a
# watched run the watchdog's report, which names the rank, always comes first.
DEFAULT_PROCESS_GROUP_TIMEOUT_S = SLOW_PHASE_FACTOR * DEFAULT_COLLECTIVE_TIMEOUT_S
# The longest wait any timeout may ask for: a week. Longer is a typo (1e15), and torch's clocks
# count in nanoseconds or milliseconds, where it would overflow into an error naming nothing.
MAX_TIMEOUT_S = 7 * 24 * 3600


class TimeoutValueError(TriaxError, ValueError):
    """A collective timeout that is not a positive number of seconds."""


def collective_timeout(value: float | None = None, source: str = "trainer.collective_timeout") -> float:
    """The collective timeout in seconds: `value` if given, else $TRIAX_COLLECTIVE_TIMEOUT (set by
    `triax launch --collective-timeout`), else DEFAULT_COLLECTIVE_TIMEOUT_S. `source` names the
    setting in the error a bad value raises."""
    if value is None:
        text = os.environ.get(ENV_COLLECTIVE_TIMEOUT, "").strip()
        if not text:
            return DEFAULT_COLLECTIVE_TIMEOUT_S
        source = f"${ENV_COLLECTIVE_TIMEOUT}"
        try:
            value = float(text)
        except ValueError:
            raise TimeoutValueError(f"{source}={text!r} is not a number of seconds; use e.g. 120") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise TimeoutValueError(f"{source}={value!r} must be a positive number of seconds, at most "
                                f"{MAX_TIMEOUT_S} (a week), e.g. 120")
    return float(value)


def slow_phase_timeout(timeout_s: float) -> float:
    """What start-up, evaluation and snapshots may take, given the collective timeout."""
    return SLOW_PHASE_FACTOR * timeout_s


def process_group_timeout() -> float:
    """The process group's timeout: $TRIAX_COLLECTIVE_TIMEOUT if set, else
    DEFAULT_PROCESS_GROUP_TIMEOUT_S."""
    if os.environ.get(ENV_COLLECTIVE_TIMEOUT, "").strip():
        return collective_timeout()
    return DEFAULT_PROCESS_GROUP_TIMEOUT_S


# Horovod's default for HOROVOD_GLOO_TIMEOUT_SECONDS (--gloo-timeout-seconds): what a Horovod
# script's collectives wait for a peer that is gone or stuck before failing, so an elastic job's
# survivors reset (HorovodInternalError) within seconds rather than the process group's ten minutes.
HOROVOD_GLOO_TIMEOUT_S = 30.0
