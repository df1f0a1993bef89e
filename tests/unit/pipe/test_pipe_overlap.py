"""Micro-batches really overlap: partitions work at the same time, in the fill-and-drain order.

The one timed test of the suite (the issue asks for it). Layers sleep instead of computing:
time.sleep releases the GIL and takes the same time on a loaded 2-core machine as on an idle one,
and the margins are wide (the threshold sits halfway between pipelined and sequential).
"""

import time

import torch
from torch import nn

from triax.pipe import Pipe
from triax.pipe.schedule import clock_cycles, pipelined_ticks

SLEEP = 0.1  # seconds per micro-batch per partition


class Sleep(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        time.sleep(SLEEP)
        return x * self.scale


def step_seconds(pipe: Pipe) -> float:
    """Fastest of two training steps (forward and backward) on 8 samples."""
    times = []
    for _ in range(2):
        began = time.perf_counter()
        pipe(torch.ones(8, 3)).sum().backward()
        times.append(time.perf_counter() - began)
    return min(times)


def test_clock_cycles_is_fill_and_drain():
    assert clock_cycles(3, 2) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    assert all(i + j == tick for tick, pairs in enumerate(clock_cycles(5, 3)) for i, j in pairs)
    assert len(clock_cycles(4, 2)) == pipelined_ticks(4, 2) == 5


def test_two_partitions_with_four_chunks_take_the_pipelined_time():
    chunks, partitions = 4, 2
    pipelined = pipelined_ticks(chunks, partitions) * SLEEP  # 0.5 s
    sequential = chunks * partitions * SLEEP  # 0.8 s
    pipe = Pipe(nn.Sequential(Sleep(), Sleep()), balance=[1, 1], devices=["cpu", "cpu"], chunks=chunks,
                checkpoint="never")
    measured = step_seconds(pipe)
    assert measured >= 0.95 * pipelined, "faster than the schedule allows: are the layers sleeping?"
    assert measured < (pipelined + sequential) / 2, (
        f"step took {measured:.3f}s: pipelined would be {pipelined:.2f}s, sequential {sequential:.2f}s")


def test_one_partition_takes_the_sequential_time():
    # The control: the same layers in one partition cannot overlap, so the measurement above means something.
    pipe = Pipe(nn.Sequential(Sleep(), Sleep()), balance=[2], devices=["cpu"], chunks=4, checkpoint="never")
    assert step_seconds(pipe) >= 0.95 * 8 * SLEEP
