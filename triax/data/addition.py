"""minGPT's addition task: learn n-digit a + b.

A sample is the digits of a, the digits of b, then the digits of the sum *reversed* (the model
writes the sum lowest digit first, as people carry). Only the sum's digits are trained on; the
targets for the question part are IGNORE_INDEX (triax.data.targets): not trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from triax.data.targets import IGNORE_INDEX
from triax.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn


class AdditionDataset(Dataset):
    def __init__(self, digits: int, split: str, seed: int = 3407):
        if not 1 <= digits <= 4:
            raise ConfigError(f"data.digits must be 1..4 for the addition task, got {digits}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.digits = digits
        count = (10 ** digits) ** 2
        # The split is fixed by its own seed, not the run's, so every run holds out the same problems.
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
        held_out = min(int(count * 0.2), 500)
        self.problems = order[:held_out] if split == "test" else order[held_out:]
        self.vocab_size = 10
        self.block_size = 3 * digits  # a, b and the (digits+1)-digit sum, less the last as input

    def __len__(self) -> int:
        return len(self.problems)

    def _render(self, problems: torch.Tensor) -> torch.Tensor:
        """(n,) problem numbers -> (n, 3·digits+1) digit sequences."""
        base = 10 ** self.digits
        a, b = problems // base, problems % base
        c = a + b
        columns = [(a // 10 ** p) % 10 for p in reversed(range(self.digits))]
        columns += [(b // 10 ** p) % 10 for p in reversed(range(self.digits))]
        columns += [(c // 10 ** p) % 10 for p in range(self.digits + 1)]  # reversed sum
        return torch.stack(columns, dim=1)

    def batch(self, indices: torch.Tensor):
        sequences = self._render(self.problems[indices])
        x, y = sequences[:, :-1].clone(), sequences[:, 1:].clone()
        y[:, : 2 * self.digits - 1] = IGNORE_INDEX
        return x, y

    def __getitem__(self, index: int):
        x, y = self.batch(torch.tensor([index]))
        return x[0], y[0]


@torch.no_grad()
def addition_accuracy(model: nn.Module, dataset: AdditionDataset, device: torch.device, batch_size: int = 500,
                      max_problems: int | None = None, use_cache: bool = True) -> float:
    """Exact-match accuracy: give the model a and b, decode the sum greedily (`use_cache`: as in
    GPT.generate), compare."""
    n = dataset.digits
    total = len(dataset) if max_problems is None else min(len(dataset), max_problems)
    correct = 0
    was_training = model.training
    model.eval()
    for start in range(0, total, batch_size):
        indices = torch.arange(start, min(start + batch_size, total))
        sequences = dataset._render(dataset.problems[indices]).to(device)
        question = sequences[:, : 2 * n]
        answer = model.generate(question, n + 1, greedy=True, use_cache=use_cache)[:, 2 * n:]
        correct += (answer == sequences[:, 2 * n:]).all(dim=1).sum().item()
    model.train(was_training)
    return correct / max(total, 1)
