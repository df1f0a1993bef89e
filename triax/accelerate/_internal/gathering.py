"""Gathering evaluation results for metrics: every process's outputs, with the samples that were
repeated to even out the last batch dropped again, so each sample of the dataset counts once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from triax.accelerate.utils import operations

if TYPE_CHECKING:
    from triax.accelerate.state import GradientState


def gather_for_metrics(input_data: Any, use_gather_object: bool, gradient_state: GradientState) -> Any:
    """gather (or gather_object, for data without tensors), then keep only the real samples of the
    last global batch of a dataloader (the rest repeat the start of the epoch)."""
    tensors_only = []
    operations.map_tensors(lambda t: tensors_only.append(t), input_data)
    if use_gather_object or not tensors_only:
        items = input_data if isinstance(input_data, list) else [input_data]
        data = operations.gather_object(items)
    else:
        data = operations.gather(input_data)
    keep = gradient_state.remainder
    if gradient_state.end_of_dataloader and keep > 0:
        if isinstance(data, list):
            return data[:keep]
        return operations.map_tensors(lambda t: t[:keep], data)
    return data
