"""FairScale's default way to cut layer costs into partitions: block partitions of a sequence.

The procedure is the one of Bárány and Grinberg, "Block partitions of sequences" (Israel J. Math.,
2015; arXiv:1308.2452): for numbers in [0, 1], there is a cut into k contiguous blocks whose
heaviest block outweighs the lightest by at most 1, and it is reached by moving one element at a
time from a block next to the lightest one into it. Costs are first rescaled onto [0, 1]
(cheapest layer 0, dearest 1), so the guarantee reads "within one dearest layer".

It is not the cut whose slowest partition is fastest, only one that is even to within a layer;
`balance_cost` (the package's `exact=True`) finds that optimum. This one stays the default because
it is what FairScale's `balance_by_time` and `balance_by_size` return, so a script gets the same
balance under either library.
"""

from __future__ import annotations

from typing import Sequence

from triax.pipe.errors import PipeValueError

__all__ = ["solve"]


def check_partitions(partitions: object, items: int, what: str = "layers") -> None:
    """Refuse a partition count that is not a whole number >= 1, or more partitions than `items`."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise PipeValueError(f"partitions must be a whole number >= 1, got {partitions!r}")
    if partitions > items:
        raise PipeValueError(f"cannot cut {items} {what} into {partitions} partitions; every partition needs "
                             f"one, so ask for at most {items}")


def solve(sequence: Sequence[float], partitions: int = 1) -> list:
    """Cut `sequence` (costs, one per layer) into `partitions` contiguous, non-empty blocks.

    Returns the blocks themselves (slices of `sequence`), as FairScale's `blockpartition.solve`:
    `solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]`.
    """
    count = len(sequence)
    check_partitions(partitions, count, "costs")
    low = min(sequence)
    spread = max(sequence) - low
    weights = [0.0] * count if spread == 0 else [(cost - low) / spread for cost in sequence]
    # FairScale breaks ties between equally light blocks by taking the first one. Where that empties a
    # block (a balance with a 0 in it, which Pipe refuses) or moves elements back and forth for ever
    # (both happen when several costs are equal), the paper's rule is used instead: the one nearest the
    # heaviest block, which keeps every block non-empty and always stops. Elsewhere the two agree.
    ends = _block_ends(weights, partitions, nearest=False)
    if ends is None:
        ends = _block_ends(weights, partitions, nearest=True)
    starts = [0] + ends[:-1]
    return [sequence[start:end] for start, end in zip(starts, ends)]


def _block_ends(weights: list[float], partitions: int, nearest: bool) -> list[int] | None:
    """Where each block ends once no block is more than 1 lighter than the heaviest; None when the
    first-lightest rule (`nearest=False`) empties a block or comes back to a cut it already had."""
    count = len(weights)
    # ends[b]: one past the last element of block b. Start from equal lengths, the remainder
    # going to the last block, as FairScale does (so both libraries land on the same cut).
    ends = [count // partitions * (block + 1) for block in range(partitions - 1)] + [count]
    seen: set[tuple] = set()
    # Exactly, moving one element (weight <= 1) cannot make a heavier block; in floating point a block
    # can come out a rounding error above, and an element then swings between two blocks for ever.
    # The paper's rule allows for that rounding; the first-lightest rule compares exactly, as FairScale.
    slack = 1e-9 * count if nearest else 0.0

    def weight(block: int) -> float:
        start = ends[block - 1] if block > 0 else 0
        return sum(weights[start:ends[block]])

    while True:
        # Step 1 of the paper: a heaviest block (ties: the last one, as FairScale's max over (weight, index)).
        heaviest_weight, heaviest = max((weight(block), block) for block in range(partitions))
        while True:
            # Step 2: stop once the lightest block is within 1 of the heaviest.
            distance = (lambda block: abs(block - heaviest)) if nearest else (lambda block: 0)
            lightest_weight, _, lightest = min((weight(block), distance(block), block) for block in range(partitions))
            if heaviest_weight <= lightest_weight + 1 + slack:
                starts = [0] + ends[:-1]
                return ends if all(end > start for start, end in zip(starts, ends)) else None
            state = (tuple(ends), heaviest)
            if state in seen:  # cuts stay within the sequence, so a rule that never stops comes back here
                return None  # only the first-lightest rule can; the paper's always progresses
            seen.add(state)
            # Step 3: the lightest block takes the nearest element of its neighbour on the heaviest's side.
            if heaviest < lightest:
                neighbour = lightest - 1
                ends[neighbour] -= 1  # the neighbour's last element moves to the lightest block
            else:
                neighbour = lightest + 1
                ends[lightest] += 1  # the neighbour's first element moves to the lightest block
            if not 0 <= ends[min(neighbour, lightest)] <= count:
                return None  # a cut outside the sequence: the first-lightest rule went astray
            # The heaviest block's weight is unchanged unless it was the neighbour that gave.
            if neighbour == heaviest:
                break
