"""Which objective trains each data.task: the one table the trainer, the configuration's checks and
the data loader iterate (none of them names an objective).

An entry says what its objective brings: its config section (the keys that apply to its task
only) and that section's checks, its data (when the task's records are its own, such as
preference pairs or GRPO's prompts), and its build for `triax train`. The builds are imported
when a run needs them: the configuration (and `--help`) stays without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from triax.errors import ConfigError
from triax.objectives import Objective, RunParts
from triax.objectives.dpo.config import check_dpo, check_preference_run
from triax.objectives.grpo.config import check_grpo, check_grpo_run


def _tokens(parts: RunParts) -> Objective:
    from triax.objectives.tokens.objective import build  # deferred: torch, for a run only
    return build(parts)


def _dpo(parts: RunParts) -> Objective:
    from triax.objectives.dpo.build import build  # deferred: torch, for a run only
    return build(parts)


def _grpo(parts: RunParts) -> Objective:
    from triax.objectives.grpo.build import build  # deferred: torch, for a run only
    return build(parts)


def _pairs(config: Any, codec: Any, source: Any, run: Any = None) -> tuple[Any, Any, str]:
    from triax.objectives.dpo.build import load_pairs  # deferred: torch, for a run only
    return load_pairs(config, codec, source, run)


def _prompts(config: Any, codec: Any, source: Any, run: Any = None) -> tuple[Any, Any, str]:
    from triax.objectives.grpo.build import load_prompts  # deferred: torch, for a run only
    return load_prompts(config, codec, source, run)


@dataclass(frozen=True)
class Entry:
    """One data.task's objective (see the module docstring)."""

    build: Callable[[RunParts], Objective]
    section: str | None = None  # its config section (TrainConfig.<section>): keys for this task only
    check_settings: Callable[[Any], None] | None = None  # its values' ranges (before any file is read)
    check_run: Callable[[Any, Any], None] | None = None  # (TrainConfig, Layout): what the run needs besides
    check_always: bool = False  # its values are checked whatever data.task is (as they always were)
    # (DataConfig, checkpoint codec, model.init_from's run, TrainConfig) -> (train, val, report), for a
    # task whose records are the objective's own; None: the trainer's data loader reads them.
    load_data: Callable[[Any, Any, Any, Any], tuple[Any, Any, str]] | None = None
    sample_unit: str = "samples"  # what one sample of a step is, on the start line
    scores_answers: bool = False  # rows of varying length whose answers alone are scored (counted as read)
    coefficient: str | None = None  # the key a run whose loss stopped being finite should check


TOKENS = Entry(_tokens)

OBJECTIVES: dict[str, Entry] = {
    "char": TOKENS,
    "tokens": TOKENS,
    "addition": TOKENS,
    "chat": Entry(_tokens, scores_answers=True),
    "preference": Entry(_dpo, "dpo", check_dpo, check_preference_run, check_always=True,
                        load_data=_pairs, sample_unit="pairs", scores_answers=True, coefficient="dpo.beta"),
    "grpo": Entry(_grpo, "grpo", check_grpo, check_grpo_run, load_data=_prompts),
}


def objective_for(task: str) -> Entry:
    """The entry of data.task `task` (one line naming the tasks there are, for another)."""
    if task not in OBJECTIVES:
        raise ConfigError(f"data.task={task!r} is invalid; use {', '.join(list(OBJECTIVES)[:-1])} or "
                          f"{list(OBJECTIVES)[-1]}")
    return OBJECTIVES[task]


def sections() -> dict[str, str]:
    """{config section: the data.task its keys apply to}."""
    return {entry.section: task for task, entry in OBJECTIVES.items() if entry.section}


def added_terms(model_config: Any) -> list:
    """What a model adds to whichever objective runs (a models.config.GPTConfig): a mixture of
    experts' router losses (triax.objectives.router)."""
    if not model_config.num_experts:
        return []
    from triax.objectives.router.term import RouterLoss  # deferred: torch, for a run only
    return [RouterLoss(model_config)]


def loss_coefficients() -> str:
    """The coefficients of the losses, for the line of a run whose loss stopped being finite."""
    named = dict.fromkeys(entry.coefficient for entry in OBJECTIVES.values() if entry.coefficient)
    return ", ".join([*named, "the router's"])
