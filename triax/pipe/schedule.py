"""The GPipe fill-and-drain order.

Micro-batch i runs on partition j at clock tick i + j. Within one tick every (i, j) pair is
independent: partition j needs micro-batch i from partition j - 1, which finished one tick earlier.
So the pairs of one tick can run at the same time, one per partition.

With m micro-batches and n partitions there are m + n - 1 ticks; the pipe is filling during the
first n - 1 and draining during the last n - 1. That is why a step takes (m + n - 1) / m of the
time of one partition's share of the work, instead of n times it when the partitions take turns.
"""

from __future__ import annotations


def clock_cycles(num_micro_batches: int, num_partitions: int) -> list[list[tuple[int, int]]]:
    """For each clock tick, the (micro_batch, partition) pairs that run in it."""
    ticks = []
    for tick in range(num_micro_batches + num_partitions - 1):
        pairs = [(tick - partition, partition) for partition in range(num_partitions)
                 if 0 <= tick - partition < num_micro_batches]
        ticks.append(pairs)
    return ticks


def pipelined_ticks(num_micro_batches: int, num_partitions: int) -> int:
    """How many ticks a fill-and-drain step takes (for the ideal time in benchmarks and tests)."""
    return num_micro_batches + num_partitions - 1
