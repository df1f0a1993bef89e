"""What a training step optimises, one folder per objective behind one small interface.

The training step asks an objective for four things and names none of them: its checks (before
any process group forms), whether it needs a reference model, the batch of a step (read from the
data, or produced: GRPO's rollout samples completions and scores them), and the loss of a
micro-batch with the metrics it logs; evaluation is the objective's too. The step hands it a
narrow `StepContext`, not itself, so an objective depends on what it reads and nothing more.

An objective lives in `triax/objectives/<name>/`: its config dataclass (TRL's names where TRL has
the objective), its checks, its loss, and whatever its batches need (GRPO: prompts, rewards,
generation). See docs/architecture.md for where a new one goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

if TYPE_CHECKING:  # the types only: the configuration imports this package, and `--help` stays without torch
    import torch


@dataclass
class StepContext:
    """What an objective may use of the step that runs it."""

    device: torch.device
    autocast: Callable[[], ContextManager]  # the precision policy's autocast on this device
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # model, ids -> logits
    grad_accum: int  # micro-batches per optimizer step
    data_parallel_size: int  # ranks that hold different samples
    data_parallel_rank: int
    seed: int  # trainer.seed: randomness an objective draws comes from (seed, its place)


class Objective(Protocol):
    """The interface an objective implements (see the module docstring)."""

    def check(self, layout: Any) -> None:
        """Refuse, in one line, a layout or setting the objective cannot run under."""

    def needs_reference(self) -> bool:
        """Whether the loss needs a frozen reference model (with LoRA: the base, adapters off)."""

    def produce_batch(self, context: StepContext, step: int, indices: torch.Tensor, model: torch.nn.Module) -> Any:
        """The batch of optimizer step `step` from this rank's data samples `indices` (GRPO: the
        completions `model`, the policy unwrapped, samples for those prompts): its len() rows, and
        `rows(part)` the micro-batch of the rows in the slice `part`."""

    def loss(self, context: StepContext, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        """The loss of one micro-batch (scaled for gradient accumulation) and its metrics."""

    def evaluate(self, context: StepContext) -> dict:
        """The objective's figures on held-out data."""

    # The few figures of its record a person watches, shown on the step line and the bar
    # (triax.tracking.line_fields): tuple[LineField, ...].
    line_fields: tuple
