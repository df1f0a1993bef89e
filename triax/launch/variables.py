"""What each FSDP_* and ACCELERATE_* variable accepts: one table, checked on both sides of a launch.

`accelerate launch` (and `triax launch` with an Accelerate config or --use_fsdp) hands its workers
their FSDP plugin and Accelerate's flags as these variables; the Accelerator reads them back at
start-up. A bad value used to surface late and far from its cause (a traceback in every worker
naming neither the option nor the variable). So it is checked:
- by `triax launch`, before any worker starts: a config file's `fsdp_config` keys and the
  --fsdp_* options under their own names, then every variable the workers would inherit;
- when an Accelerator (its PartialState) or a FullyShardedDataParallelPlugin is made, for a
  variable set by hand or by another launcher.
Each problem is one line naming the setting and its value, and what is accepted. What the values
mean is decided where they are used (triax/accelerate/_internal/fsdp_plugin.py and options.py,
triax/accelerate/state.py); this module only knows their spelling, and imports nothing heavy (the
launcher checks before torch).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping

from triax.errors import UsageError
from triax.launch.settings import PRECISION_POLICIES

# Accelerate's str_to_bool words (case-insensitive).
TRUE_WORDS = ("y", "yes", "t", "true", "on", "1")
FALSE_WORDS = ("n", "no", "f", "false", "off", "0")
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
BACKWARD_PREFETCHES = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")
# Far more parameters than any model has, and few enough digits that int() is instant (Python
# refuses to convert more than 4300 digits, with an error naming no variable).
MAX_MIN_NUM_PARAMS = 10**15
MAX_ACCUMULATION_STEPS = 10**6
MAX_PATTERN_CHARACTERS = 1000
_CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
# torch.device's types (c10's DeviceType names), any of which Accelerate hands to torch.device.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "xla", "meta", "hpu", "mtia", "ipu", "lazy", "vulkan", "maia",
                "privateuseone", "hip", "ve", "fpga", "opengl", "opencl", "ideep", "mkldnn")
_DEVICE = re.compile(rf"^({'|'.join(DEVICE_TYPES)})(:[0-9]{{1,5}})?$")


def _truth(text: str) -> bool:
    return text.lower() in TRUE_WORDS + FALSE_WORDS


def _named(names: tuple[str, ...], numbers: int = 0) -> Callable[[str], bool]:
    """One of `names` (any case), or the enum's number 1..`numbers` (torch's enums count from 1)."""
    return lambda text: text.upper() in names or (text.isdigit() and len(text) < 3 and 1 <= int(text) <= numbers)


def _whole(low: int, high: int) -> Callable[[str], bool]:
    return lambda text: text.isdigit() and len(text) <= len(str(high)) and low <= int(text) <= high


def _pattern(text: str) -> bool:
    if len(text) > MAX_PATTERN_CHARACTERS:
        return False
    try:
        re.compile(text)
    except (re.error, RecursionError, OverflowError):
        return False
    return True


def _class_names(text: str) -> bool:
    return all(_CLASS_NAME.match(name.strip()) for name in text.split(","))


_TRUTH_WHAT = "use true or false"
# variable -> (accepts(text), what to write instead)
VARIABLES: dict[str, tuple[Callable[[str], bool], str]] = {
    "FSDP_VERSION": (lambda text: text in ("1", "2"), "use 1 or 2 (2: FSDP2, fully_shard)"),
    "FSDP_SHARDING_STRATEGY": (_named(SHARDING_STRATEGIES, 5), f"use one of {', '.join(SHARDING_STRATEGIES)} (or 1..5)"),
    "FSDP_RESHARD_AFTER_FORWARD": (lambda text: _truth(text) or _named(SHARDING_STRATEGIES, 5)(text),
                                   "use true or false (FSDP2), or a sharding strategy such as FULL_SHARD (FSDP1)"),
    "FSDP_OFFLOAD_PARAMS": (_truth, _TRUTH_WHAT),
    "FSDP_MIN_NUM_PARAMS": (_whole(0, MAX_MIN_NUM_PARAMS), f"use a whole number of parameters, 0 .. {MAX_MIN_NUM_PARAMS}"),
    "FSDP_AUTO_WRAP_POLICY": (_named(AUTO_WRAP_POLICIES), f"use one of {', '.join(AUTO_WRAP_POLICIES)}"),
    "FSDP_TRANSFORMER_CLS_TO_WRAP": (_class_names, "use layer class names separated by commas, e.g. LlamaDecoderLayer"),
    "FSDP_BACKWARD_PREFETCH": (_named(BACKWARD_PREFETCHES, 2), f"use one of {', '.join(BACKWARD_PREFETCHES)}"),
    "FSDP_STATE_DICT_TYPE": (_named(STATE_DICT_TYPES, 3), f"use one of {', '.join(STATE_DICT_TYPES)}"),
    "FSDP_FORWARD_PREFETCH": (_truth, _TRUTH_WHAT),
    "FSDP_USE_ORIG_PARAMS": (_truth, _TRUTH_WHAT),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": (_truth, _TRUTH_WHAT),
    "FSDP_SYNC_MODULE_STATES": (_truth, _TRUTH_WHAT),
    "FSDP_ACTIVATION_CHECKPOINTING": (_truth, _TRUTH_WHAT),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": (_truth, _TRUTH_WHAT),
    "FSDP_IGNORED_MODULES": (_pattern, "use a regular expression that module names must match in full, "
                                       f"at most {MAX_PATTERN_CHARACTERS} characters"),
    "ACCELERATE_USE_FSDP": (_truth, _TRUTH_WHAT),
    "ACCELERATE_USE_CPU": (_truth, _TRUTH_WHAT),
    "ACCELERATE_DEBUG_MODE": (_truth, _TRUTH_WHAT),
    "ACCELERATE_USE_DEEPSPEED": (_truth, _TRUTH_WHAT),
    "ACCELERATE_USE_MEGATRON_LM": (_truth, _TRUTH_WHAT),
    "ACCELERATE_USE_XLA": (_truth, _TRUTH_WHAT),
    "ACCELERATE_ENABLE_RICH": (_truth, _TRUTH_WHAT),
    "FORK_LAUNCHED": (_truth, _TRUTH_WHAT),
    "ACCELERATE_MIXED_PRECISION": (lambda text: text in PRECISION_POLICIES or text == "fp8",
                                   f"use one of {', '.join(PRECISION_POLICIES)}"),
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": (_whole(1, MAX_ACCUMULATION_STEPS),
                                               f"use a whole number, 1 .. {MAX_ACCUMULATION_STEPS}"),
    "ACCELERATE_TORCH_DEVICE": (lambda text: bool(_DEVICE.match(text)), "use a torch device such as cpu, cuda or cuda:N"),
    "ACCELERATE_LOG_LEVEL": (lambda text: text.upper() in LOG_LEVELS, f"use one of {', '.join(LOG_LEVELS[2:])}"),
}


def check_value(variable: str, value: object, shown: str | None = None, error: type[Exception] = UsageError) -> None:
    """Raise `error` (one line naming `shown`, else `$variable`, and the value) unless `value`
    is a spelling `variable` accepts. Non-strings are judged by their text (a config file's
    `fsdp_version: 2` is "2", its `fsdp_min_num_params: [1]` is refused)."""
    accepts, what = VARIABLES[variable]
    text = str(value)
    if len(text) <= 10 * MAX_PATTERN_CHARACTERS and accepts(text):
        return
    shown_value = value if len(text) <= 80 else f"{text[:40]}...({len(text)} characters)"
    raise error(f"{shown or '$' + variable}={shown_value!r} is invalid; {what}")


def check_environment(environ: Mapping[str, str], error: type[Exception] = UsageError,
                      already_checked: Iterable[str] = ()) -> None:
    """Every FSDP_* / ACCELERATE_* variable of VARIABLES set in `environ`, and the one rule that
    joins two of them: under FSDP2 (FSDP_VERSION=2) FSDP_RESHARD_AFTER_FORWARD is true or false."""
    for variable in VARIABLES:
        if variable in environ and variable not in already_checked:
            check_value(variable, environ[variable], error=error)
    reshard = environ.get("FSDP_RESHARD_AFTER_FORWARD")
    if environ.get("FSDP_VERSION") == "2" and reshard is not None and not _truth(reshard):
        raise error(f"$FSDP_RESHARD_AFTER_FORWARD={reshard!r} is invalid with FSDP_VERSION=2; use true or false")
