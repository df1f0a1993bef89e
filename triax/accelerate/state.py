"""What the Accelerator, its dataloaders, optimizers and schedulers share during a step.

One small object instead of a process-wide singleton: the dataloader says when an epoch ends,
`accumulate` decides whether this micro-step synchronises gradients, and the optimizer and
scheduler wrappers read that decision.
"""

from __future__ import annotations


class GradientState:
    def __init__(self, accumulation_steps: int = 1):
        self.accumulation_steps = accumulation_steps
        self.sync_gradients = True
        self.micro_step = 0  # micro-steps since the last synchronising one, inside `accumulate`
        self.active_loaders: list = []  # innermost (currently iterated) dataloader last

    @property
    def active_loader(self):
        return self.active_loaders[-1] if self.active_loaders else None

    @property
    def end_of_dataloader(self) -> bool:
        loader = self.active_loader
        return bool(loader is not None and loader.at_end)

    @property
    def padding_in_last_batch(self) -> int:
        """How many of the last global batch's samples repeat earlier ones (even_batches)."""
        loader = self.active_loader
        return loader.padding_in_last_batch if loader is not None else 0

    def next_micro_step(self) -> bool:
        """Advance `accumulate`'s counter; True when this micro-step must synchronise: every
        `accumulation_steps`-th one, and always the last batch of an epoch (so no gradient
        is carried across epochs)."""
        self.micro_step += 1
        self.sync_gradients = (self.micro_step % self.accumulation_steps == 0) or self.end_of_dataloader
        if self.sync_gradients:
            self.micro_step = 0
        return self.sync_gradients
