"""The reference model an objective's loss compares the policy with (DPO's, GRPO's KL term), in the
one form the run allows, chosen in one place for every objective (`reference_for`, which the
trainer calls for DPO and GRPO alike, and `triax eval` for a finished DPO run):

- full fine-tuning: a model of its own, model.init_from built again in the policy's layout and
  frozen (each rank holds its part alone; never in the optimizer or the snapshots);
- LoRA with model.lora.init_from: the policy itself with the adapters as read put back in place
  for the reference's forward (TRL's "ref" adapter), the trained ones restored after it;
- LoRA with new adapters: the policy with its adapters switched off (the base), no second model
  in memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from triax.models.lora import adapters_disabled, is_adapter


class Reference:
    """The frozen reference: `model` (a model of its own) or, on the policy, the adapters `kept`
    as read (or, with neither, the policy with its adapters off)."""

    def __init__(self, model: torch.nn.Module | None = None,
                 kept: list[tuple[torch.nn.Parameter, torch.Tensor]] | None = None):
        self.model = model
        self.kept = kept

    def module(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The module whose forward is the reference's: a model of its own, else the policy (under `switched`)."""
        return self.model if self.model is not None else policy

    @contextlib.contextmanager
    def switched(self) -> Iterator[None]:
        """The policy made the reference for the duration (nothing to switch with a model of its own)."""
        if self.model is not None:
            yield
            return
        if self.kept is None:
            with adapters_disabled():
                yield
            return
        with torch.no_grad():
            current = [parameter.detach().clone() for parameter, _ in self.kept]
            for parameter, initial in self.kept:
                parameter.copy_(initial)
        try:
            yield
        finally:
            with torch.no_grad():
                for (parameter, _), value in zip(self.kept, current):
                    parameter.copy_(value)


@torch.no_grad()
def kept_adapters(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """The model's adapters as they are now (as read from model.lora.init_from, before a resume
    replaces them), to be put back in place for the reference's forward."""
    return [(parameter, parameter.detach().clone()) for name, parameter in model.named_parameters() if is_adapter(name)]


def reference_for(lora: Any, policy: torch.nn.Module | None, frozen: Callable[[], torch.nn.Module]) -> Reference:
    """The reference in the form model.lora (`lora`: a LoRAConfig) allows (the module docstring):
    without LoRA a model of its own, which `frozen` builds; with adapters read from
    model.lora.init_from, those of `policy` as they are now; else the policy with its adapters off."""
    if not lora.rank:
        return Reference(model=frozen())
    return Reference(kept=kept_adapters(policy) if lora.init_from else None)
