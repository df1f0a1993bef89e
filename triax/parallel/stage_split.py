"""Which layers each pipeline stage holds: plain arithmetic, shared by the pipeline
(triax.parallel.pipeline_parallel) and `triax plan`, which counts a stage's parameters without
importing torch.distributed.pipelining (a second of a command's start-up)."""

from __future__ import annotations


def split_layers(n_layer: int, stages: int, balance: list[int] | None = None) -> list[list[int]]:
    """Layer numbers of each stage: `balance[s]` layers for stage s if given, else as even as
    possible, with any extra layers on the middle stages (the ends also run embedding / head)."""
    if not balance:
        base, extra = divmod(n_layer, stages)
        # Extra layers go to the middle stages: the ends already carry the embedding / head.
        order = sorted(range(stages), key=lambda s: abs(s - (stages - 1) / 2))
        balance = [base + (1 if s in order[:extra] else 0) for s in range(stages)]
    ranges, start = [], 0
    for count in balance:
        ranges.append(list(range(start, start + count)))
        start += count
    return ranges
