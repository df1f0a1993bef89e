"""Reward functions: user code with TRL's signature, and a few verifiable rewards built in.

A reward function is called as TRL calls it: `function(prompts=..., completions=...,
completion_ids=..., **columns)`, where `columns` are the prompt records' other fields (an `answer`,
a test), one value per completion, and returns one float per completion, or None where it does not
apply. It is named in grpo.reward_funcs as `path/to/file.py:function`, `package.module:function`
or a built-in name. It is the user's code, run as the user asked; what triax checks is what it
gives back: a call that raises, returns another number of rewards, a value that is not a number,
or NaN/infinity, or runs past grpo.reward_timeout seconds stops the run with one line naming the
function and the record (file and line) whose completion it was scoring.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from triax import safe_files
from triax.errors import ConfigError, TriaxError, printable

MAX_REWARD_SOURCE_BYTES = 4 * 2**20  # a file of reward functions is code a person wrote, not data


class RewardConfigError(ConfigError, ValueError):
    """grpo.reward_funcs names something that is not a reward function triax can load."""


class RewardFailure(TriaxError, RuntimeError):
    """A reward function raised, hung, or gave back something that is not one number per completion."""


class RewardTimeout(Exception):
    """Raised inside a reward function's call when its time is up (caught here, never shown as is)."""


@dataclass
class RewardFunction:
    name: str  # as logged: rewards/<name>/mean
    function: Callable[..., Any]


# ---- built in -------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"^\s*(<think>(?:(?!<think>).)*?</think>\s*)?<answer>(?:(?!<answer>).)*?</answer>\s*$", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or (conversational) its last message's content."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def final_answer(text: str) -> str:
    """The answer a completion ends with: the last \\boxed{...}, else the last <answer>...</answer>,
    else what follows the last '####' (GSM8K's mark), else the whole text; stripped."""
    for pattern in (_BOXED, _ANSWER_TAG):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


def exact_match(prompts: list, completions: list, answer: list | None = None, **_: Any) -> list[float | None]:
    """1 where the completion's final answer is the record's `answer` (as text, stripped), else 0;
    None for a record without one."""
    if answer is None:
        raise RewardFailure("the built-in exact_match reward needs an `answer` field in the prompt records")
    return [None if expected is None else float(final_answer(completion_text(completion)) == str(expected).strip())
            for completion, expected in zip(completions, answer)]


def format_reward(prompts: list, completions: list, **_: Any) -> list[float]:
    """1 where the completion is an optional <think>...</think> then one <answer>...</answer>, and
    nothing else; else 0."""
    return [float(bool(_FORMAT.match(completion_text(completion)))) for completion in completions]


BUILT_IN = {"exact_match": exact_match, "format": format_reward}


# ---- loading --------------------------------------------------------------------------------------

def _module_from_file(path: str, option: str) -> types.ModuleType:
    if os.path.splitext(path)[1] != ".py":
        raise RewardConfigError(f"{option}: {printable(path)!r} is not a .py file; name a Python file of reward "
                                "functions (path/to/rewards.py:function) or a module (package.module:function)")
    try:
        source = safe_files.read_text(path, MAX_REWARD_SOURCE_BYTES)
    except FileNotFoundError:
        raise RewardConfigError(f"{option}: {printable(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, TriaxError) as error:
        raise RewardConfigError(f"{option}: {printable(path)!r} cannot be read: {printable(str(error))}") from None
    name = "triax_rewards_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module = types.ModuleType(name)
    module.__file__ = os.path.abspath(path)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name while it runs
    try:
        exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102 - the user's reward code, as they asked
    except BaseException as error:  # noqa: BLE001 - the user's file failed to load: one line, whatever it raised
        del sys.modules[name]
        raise RewardConfigError(f"{option}: loading {printable(path)!r} raised {type(error).__name__}: "
                                f"{printable(str(error))[:300]}") from None
    return module


def load_reward(spec: str, option: str = "grpo.reward_funcs") -> RewardFunction:
    """A reward function from a built-in name, `path/to/file.py:function` or `module:function`."""
    if spec in BUILT_IN:
        return RewardFunction(spec, BUILT_IN[spec])
    where, colon, attribute = spec.rpartition(":")
    if not colon or not where or not attribute.isidentifier():
        raise RewardConfigError(f"{option}: {printable(spec)!r} is neither a built-in reward ({', '.join(BUILT_IN)}) "
                                "nor path/to/file.py:function or package.module:function")
    if where.endswith(".py") or os.sep in where:
        module = _module_from_file(where, option)
    else:
        try:
            module = importlib.import_module(where)
        except BaseException as error:  # noqa: BLE001 - the user's module failed to import: one line
            raise RewardConfigError(f"{option}: importing {printable(where)!r} raised {type(error).__name__}: "
                                    f"{printable(str(error))[:300]}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardConfigError(f"{option}: {printable(where)!r} has no function {attribute!r}"
                                + ("" if function is None else f" (it is a {type(function).__name__})"))
    return RewardFunction(attribute, function)


def load_rewards(specs: Sequence[str]) -> list[RewardFunction]:
    functions = [load_reward(spec) for spec in specs]
    names = [function.name for function in functions]
    for index, function in enumerate(functions):  # two functions of one name log apart: name, name_2
        if names.count(function.name) > 1:
            function.name = f"{function.name}_{names[:index + 1].count(function.name)}"
    return functions
