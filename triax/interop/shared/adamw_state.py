"""torch's AdamW state_dict as another tool saved it (nanoGPT's ckpt.pt, a transformers Trainer's
optimizer.pt): its per-parameter state is numbered by the order the tool listed its parameters,
group after group. `moments` names that state by parameter and checks every entry before anything
is loaded; the tool's reader supplies the order and the shapes.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from triax.interop.shared.pickled import PickledFileError
from triax.errors import printable

MOMENTS = ("exp_avg", "exp_avg_sq")


def moments(state: dict, order: list[str], shape_of: Callable[[str], tuple | None], where: str,
            max_step: float = 2**48) -> tuple[dict[str, dict], float]:
    """({parameter name: {"exp_avg": tensor, "exp_avg_sq": tensor}}, the step count they share) from
    `state` ({index: {"step", "exp_avg", "exp_avg_sq"}}) numbered as `order` names the parameters;
    each moment a floating tensor of the parameter's shape (`shape_of`), each step count in
    1..max_step, all the same. `where` names the file in messages."""
    named, steps = {}, set()
    for index, name in enumerate(order):
        entry = state.get(index)
        if not isinstance(entry, dict):
            raise PickledFileError(f"{where}: its optimizer has no state for parameter {index} ({name}); a "
                                   "checkpoint saved before the first step has nothing to continue")
        shape = shape_of(name)
        for key in MOMENTS:
            value = entry.get(key)
            if not (isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) == shape):
                raise PickledFileError(f"{where}: its optimizer's {key} of {name} is not a floating tensor of the "
                                       f"parameter's shape {list(shape or ())}")
        step = entry.get("step")
        step = float(step) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        if not (isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
                and 0 < step <= max_step):
            raise PickledFileError(f"{where}: its optimizer's step count for {name} is {printable(repr(step))[:40]}, "
                                   f"not in 1..{max_step:.0f}")
        steps.add(float(step))
        named[name] = {key: entry[key] for key in MOMENTS}
    if len(steps) != 1:
        raise PickledFileError(f"{where}: its optimizer's parameters have different step counts {sorted(steps)[:4]}")
    return named, steps.pop()
