"""What a training step optimises, one folder per objective behind one small interface.

The training step asks an objective for four things and names none of them: its checks (before
any process group forms), whether it needs a reference model, the batch of a step (read from the
data, or produced: GRPO's rollout samples completions and scores them), and the loss of a
micro-batch with the metrics it logs; evaluation is the objective's too. The step hands it a
narrow `StepContext`, not itself, so an objective depends on what it reads and nothing more.

An objective lives in `triax/objectives/<name>/`: its config dataclass (TRL's names where TRL has
the objective), its checks, its loss, and whatever its batches need (GRPO: prompts, rewards,
generation); `registry.py` says which data.task it trains. The token loss (tokens/) is the
objective of the text tasks; the router losses of a mixture of experts (router/) are a term
added to whichever objective runs; the reference model an objective may need is built in one
place, in one of its forms (reference.py). See docs/architecture.md for where a new one goes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

if TYPE_CHECKING:  # the types only: the configuration imports this package, and `--help` stays without torch
    import torch

    from triax.objectives.reference import Reference


@dataclass
class StepContext:
    """What an objective may use of the step that runs it."""

    device: torch.device
    autocast: Callable[[], ContextManager]  # the precision policy's autocast on this device
    # (model, ids) -> logits; (model, ids, logits=False) -> the final hidden states (triax.objectives.chunked_logits)
    forward: Callable[..., torch.Tensor]
    grad_accum: int  # micro-batches per optimizer step
    data_parallel_size: int  # ranks that hold different samples
    data_parallel_rank: int
    seed: int  # trainer.seed: randomness an objective draws comes from (seed, its place)
    world_size: int = 1  # every rank of the job (tensor-parallel peers hold the same samples)
    # Tensor parallelism's vocabulary-sharded logits: the loss runs under loss_parallel.
    loss_context: Callable[[], ContextManager] = contextlib.nullcontext
    # (dataset, sample indices) -> this rank's (inputs, targets) of them on the device.
    read: Callable[[Any, torch.Tensor], tuple] | None = None


@dataclass
class RunParts:
    """What `triax train` hands an objective's build (triax.objectives.registry)."""

    config: Any  # the TrainConfig
    data: Any  # its TrainData: the objective's datasets, the checkpoint's tokenizer
    model: torch.nn.Module | None  # the policy, plain (sharded in place; None on a pipeline rank)
    device: torch.device
    autocast: Callable[[], ContextManager]
    data_parallel_size: int
    token_loss: Callable  # (logits, targets, reduction) -> the token cross-entropy, compiled or not


class Objective(Protocol):
    """The interface an objective implements (see the module docstring)."""

    # Whether it produces the step's batch (produce_batch); else the step reads (inputs, targets) from the data.
    produces_batches: bool
    # Whether its loss is the mean over every scored token of the step (rows that score varying numbers).
    mean_per_token: bool
    # Whether an evaluation prints a text sample of the model besides the objective's figures.
    text_samples: bool

    def check(self, layout: Any) -> None:
        """Refuse, in one line, a layout or setting the objective cannot run under."""

    def needs_reference(self) -> bool:
        """Whether the loss needs a frozen reference model (triax.objectives.reference)."""

    def use_reference(self, reference: Reference) -> None:
        """The run's reference (asked for by needs_reference), built by the trainer in one place."""

    def produce_batch(self, context: StepContext, step: int, indices: torch.Tensor, model: torch.nn.Module) -> Any:
        """The batch of optimizer step `step` from this rank's data samples `indices` (GRPO: the
        completions `model`, the policy unwrapped, samples for those prompts): its len() rows, and
        `rows(part)` the micro-batch of the rows in the slice `part`."""

    def loss(self, context: StepContext, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss of one micro-batch its backward runs on: its share of the step's, scaled for
        gradient accumulation; the micro-batch's loss as logged: the step line shows their sum over
        the micro-batches / grad_accum). A batch read from the data is (inputs, targets, per_token):
        per_token, with mean_per_token, turns summed token losses into this rank's share of the step's
        token mean (else None). The objective keeps its metrics for take_figures."""

    def take_figures(self) -> dict:
        """Its metrics since the last call, for the log line (a collective: every rank calls it)."""

    def evaluate(self, context: StepContext) -> dict | None:
        """The objective's figures on held-out data (None: the token loss over the validation
        windows, which the trainer's evaluation scores)."""

    # Optimizer steps one produced batch serves (a rollout trained on several times): the data advance after the
    # last of them, and produce_batch is asked again, with the same samples, for each.
    steps_per_batch: int

    # The few figures of its record a person watches, shown on the step line and the bar
    # (triax.tracking.line_fields): tuple[LineField, ...].
    line_fields: tuple
