"""Numbers read from a state file are finite and within what their field allows.

A state file (a snapshot's state.json, re-signed by whoever can write the run directory) is
input: a learning rate of NaN or a beta of Infinity would not fail at load, it would turn every
weight into NaN at the next step, and the next snapshots (with keep_last, the only ones) would
hold nothing else. So the checks happen here, before anything is loaded.
"""

from __future__ import annotations

import math

# Counters and positions (steps, epochs, sample indices): far beyond any run, and exact in a float.
MAX_COUNT = 2**48

# Optimizer and scheduler fields and their allowed ranges: (low, high, low_open, high_open).
RANGES = {
    "lr": (0.0, math.inf, False, True), "initial_lr": (0.0, math.inf, False, True),
    "base_lrs": (0.0, math.inf, False, True), "_last_lr": (0.0, math.inf, False, True),
    "min_lr": (0.0, math.inf, False, True), "eta_min": (0.0, math.inf, False, True),
    "betas": (0.0, 1.0, False, True), "momentum": (0.0, 1.0, False, False),
    "eps": (0.0, math.inf, True, True), "weight_decay": (0.0, math.inf, False, True),
    "dampening": (0.0, 1.0, False, False), "alpha": (0.0, 1.0, False, False),
}
COUNTERS = ("step", "epoch", "sample_index", "last_epoch", "_step_count", "micro_step", "batch", "num_samples")


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _in_range(value: object, low: float, high: float, low_open: bool, high_open: bool) -> bool:
    return (is_number(value) and math.isfinite(value) and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high))


# Top-level keys of a state file that hold the run's config rather than optimizer or scheduler
# state: their numbers must be finite, but a field name there is a config key, not an optimizer
# field (model.lora.alpha is LoRA's scale, not RMSprop's alpha in [0, 1]).
CONFIG_KEYS = ("config",)


def bad_number(value: object, path: str = "", ranges: bool = True) -> str | None:
    """The first number in a JSON-like value that is not finite or out of its field's range, as
    'path=value'; None when all are fine."""
    if isinstance(value, dict):
        for key, item in value.items():
            key = str(key)
            where = f"{path}.{key}" if path else key
            plain = _plain(item)
            if not path and key in CONFIG_KEYS:
                found = bad_number(item, where, ranges=False)
                if found:
                    return found
                continue
            if ranges and key in RANGES:
                for number in (map(_plain, plain) if isinstance(plain, (list, tuple)) else [plain]):
                    if is_number(number) and not _in_range(number, *RANGES[key]):
                        return f"{where}={number!r}"
            if ranges and key in COUNTERS and is_number(plain) and not (type(plain) is int and -1 <= plain <= MAX_COUNT):
                return f"{where}={plain!r}"
            if _spelled_float(item):
                continue  # inf or nan written on purpose, in a field without a range (a plateau's best)
            found = bad_number(item, where, ranges)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = bad_number(item, f"{path}[{index}]", ranges)
            if found:
                return found
    elif isinstance(value, float) and not math.isfinite(value):
        return f"{path}={value!r}"
    elif type(value) is int and abs(value) > 2**63:
        return f"{path}={value!r}"
    return None


def _spelled_float(item: object) -> bool:
    return isinstance(item, dict) and set(item) == {"__float__"} and item["__float__"] in ("inf", "-inf", "nan")


def _plain(item: object):
    """The Accelerator's JSON spellings of a tuple and of inf / nan (triax/accelerate/_internal/saving.py),
    as the values they stand for, so a range applies to them too."""
    if isinstance(item, dict) and set(item) == {"__tuple__"}:
        return item["__tuple__"]
    return float(item["__float__"]) if _spelled_float(item) else item


def reject_constant(name: str):
    """json.loads(parse_constant=...): NaN and Infinity are not JSON and never a valid value."""
    raise ValueError(f"{name} is not a finite number")


def finite_float(text: str) -> float:
    """json.loads(parse_float=...): 1e999 parses as infinity; refuse it."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value
