"""Calling the reward functions on a batch of completions, as TRL's GRPOTrainer calls them, and
checking what each gives back (one line naming the function and the record otherwise)."""

from __future__ import annotations

import math
import numbers
import signal
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch

from triax.errors import printable
from triax.objectives.grpo.rewards import RewardFailure, RewardFunction, RewardTimeout

MAX_NAMED_RECORDS = 3  # a failed call names the records it scored, the first few of them


def _records(places: Sequence[str]) -> str:
    unique = list(dict.fromkeys(places))
    named = ", ".join(unique[:MAX_NAMED_RECORDS])
    return f"record {named}" if len(unique) == 1 else (
        f"records {named}" + (f" and {len(unique) - MAX_NAMED_RECORDS} more" if len(unique) > MAX_NAMED_RECORDS else ""))


def _on_alarm(signum: int, frame: object) -> None:
    raise RewardTimeout()


def _call_in_main_thread(function: Callable, kwargs: dict, seconds: float) -> Any:
    """An interval timer interrupts the call (a signal runs its handler on the main thread, between
    bytecodes or on a system call's EINTR); the previous handler and timer are put back."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return function(**kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_in_thread(function: Callable, kwargs: dict, seconds: float) -> Any:
    """Off the main thread no signal reaches the call: it runs on a daemon thread that is waited for
    `seconds`, and left behind (the run stops) if it has not returned."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function(**kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread as is
            outcome["error"] = error

    worker = threading.Thread(target=run, name="triax-reward", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise RewardTimeout()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def call_with_time_limit(function: Callable, kwargs: dict, seconds: float) -> Any:
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _call_in_main_thread(function, kwargs, seconds)
    return _call_in_thread(function, kwargs, seconds)


def _value(reward: RewardFunction, value: Any, place: str) -> float:
    if value is None:
        return math.nan  # the function does not apply to this completion (TRL's None)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardFailure(f"reward function {reward.name!r} returned {printable(repr(value))[:80]} "
                            f"({type(value).__name__}) for the completion of record {place}: a reward is a number or None")
    if not math.isfinite(float(value)):
        raise RewardFailure(f"reward function {reward.name!r} returned {float(value)} for the completion of record "
                            f"{place}: a reward is a finite number (None where it does not apply)")
    return float(value)


def _checked(reward: RewardFunction, result: Any, places: Sequence[str]) -> list[float]:
    if isinstance(result, (torch.Tensor, np.ndarray)) and result.ndim == 1:
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        raise RewardFailure(f"reward function {reward.name!r} returned a {type(result).__name__} scoring the "
                            f"completions of {_records(places)}: it must return a list, one reward per completion")
    if len(result) != len(places):
        raise RewardFailure(f"reward function {reward.name!r} returned {len(result)} rewards for {len(places)} "
                            f"completions (of {_records(places)}): it must return one per completion")
    return [_value(reward, value, place) for value, place in zip(result, places)]


def score(rewards: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], places: Sequence[str], timeout: float) -> torch.Tensor:
    """(completions, functions) fp32 rewards, NaN where a function returned None. `columns`: the
    records' other fields, one value per completion; `places`: each completion's record (file:line)."""
    table = torch.empty(len(completions), len(rewards), dtype=torch.float32)
    for column, reward in enumerate(rewards):
        kwargs = {**columns, "prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        try:
            result = call_with_time_limit(reward.function, kwargs, timeout)
        except RewardTimeout:
            raise RewardFailure(f"reward function {reward.name!r} ran past grpo.reward_timeout={timeout:g} s scoring "
                                f"the completions of {_records(places)}; make it faster or raise the limit") from None
        except RewardFailure:
            raise
        except BaseException as error:  # noqa: BLE001 - the user's code failed: one line naming it and the records
            if isinstance(error, KeyboardInterrupt):
                raise
            raise RewardFailure(f"reward function {reward.name!r} raised {type(error).__name__}: "
                                f"{printable(str(error))[:200]} scoring the completions of {_records(places)}") from None
        table[:, column] = torch.tensor(_checked(reward, result, places), dtype=torch.float32)
    return table
