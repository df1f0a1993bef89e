"""The figures TRL's GRPOTrainer logs of its loss, reduced across ranks as TRL reduces them.

TRL logs, per micro-batch, the mean over every rank's completion tokens of the KL, the entropy and
the clipped shares (at sequence level: the mean over completions), and the lowest and highest
per-completion clipped share; a log line shows the mean of those per-micro-batch figures. Here each
micro-batch keeps its sums and counts, and `take` adds them across ranks once, at the log line.
"""

from __future__ import annotations

import math

import torch

from triax.objectives.grpo.loss import TokenTerms

MEANS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _sum_and_count(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    if values.size(1) == 1:  # sequence level: one value per completion
        return float(values.sum()), float(values.size(0))
    return float((values * mask).sum()), float(mask.sum())


def _per_completion(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Each completion's mean (NaN for a completion with no token in the loss, left out of min/max)."""
    if values.size(1) == 1:
        return values.squeeze(1).tolist()
    return ((values * mask).sum(-1) / mask.sum(-1)).tolist()


class LossFigures:
    """The loss figures of the micro-batches since the last log line."""

    def __init__(self):
        self.sums: list[list[float]] = []  # per micro-batch: (sum, count) of each of MEANS, flattened
        self.low: list[float] = []  # per micro-batch: the lowest share of a completion's tokens clipped low
        self.high: list[float] = []  # per micro-batch: the highest share clipped high

    @torch.no_grad()
    def add(self, terms: TokenTerms, clipped: dict[str, torch.Tensor], entropies: torch.Tensor,
            mask: torch.Tensor) -> None:
        mask = mask.float()
        row = [*(_sum_and_count(terms.kl, mask) if terms.kl is not None else (math.nan, 0.0)),
               *_sum_and_count(entropies, mask)]
        for name in ("low", "high", "region"):
            row += _sum_and_count(clipped[name], mask)
        self.sums.append(row)
        lows = [value for value in _per_completion(clipped["low"], mask) if not math.isnan(value)]
        highs = [value for value in _per_completion(clipped["high"], mask) if not math.isnan(value)]
        self.low.append(min(lows, default=math.nan))
        self.high.append(max(highs, default=math.nan))

    def take(self, gather=None) -> dict[str, float]:
        """The log line's figures; `gather` (a list of floats -> every rank's lists) adds the ranks'
        (triax.runtime.shared_decisions.gather_floats; None: this process alone). Every rank calls
        it with the same number of micro-batches."""
        flat = [value for row in self.sums for value in row]
        count = len(self.sums)
        mine = flat + self.low + self.high
        ranks = gather(mine) if gather is not None else [mine]
        width = len(MEANS) * 2
        totals = [sum(column) for column in zip(*(values[:len(flat)] for values in ranks))]
        figures: dict[str, float] = {}
        for index, name in enumerate(MEANS):
            per_micro = [totals[start + 2 * index] / max(totals[start + 2 * index + 1], 1.0)
                         for start in range(0, len(totals), width)]
            if per_micro and not (name == "kl" and math.isnan(per_micro[0])):
                figures[name] = sum(per_micro) / len(per_micro)
        for name, offset, pick in (("clip_ratio/low_min", len(flat), min), ("clip_ratio/high_max", len(flat) + count, max)):
            per_micro = [pick((values[offset + micro] for values in ranks if not math.isnan(values[offset + micro])),
                              default=math.nan) for micro in range(count)]
            figures[name] = sum(per_micro) / len(per_micro) if per_micro else math.nan
        self.sums, self.low, self.high = [], [], []
        return figures
