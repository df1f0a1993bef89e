"""Which validation windows an evaluation reads, so that the loss it reports measures the split.

A window dataset (characters or token files) offers a window at every token: window i predicts
targets i+1 .. i+B (B = block size). Reading consecutive window indices, as evaluation once did,
covers a few hundred tokens and counts each up to B times. Here the split is tiled instead:

* windows start at 0, B, 2B, ... so each target is predicted once, with a full context for all
  but the first B-1 targets of each window (as nanoGPT's and transformers' evaluations do);
* the tail the tiling misses gets one last window, ending at the split's last token, whose
  already-counted leading targets are skipped (`skip`), so every target of the split counts once;
* `eval_batches=N` reads N global batches of these windows (N x batch_size x data-parallel
  processes), evenly spaced over the whole split;
  `eval_batches=0` reads them all: the whole split, exactly.

The choice depends only on the split, the block size, the global batch and eval_batches: every
layout and process count with the same global batch evaluates the same tokens. Data-parallel ranks take every dp-th window; a rank
short of a full batch is padded with windows that count nothing, so every rank runs the same
number of forward passes (FSDP and tensor parallelism need that).
"""

from __future__ import annotations

import math


def tiled_windows(num_windows: int, block_size: int) -> list[tuple[int, int]]:
    """(start, skip) of every window tiling a split that offers `num_windows` window starts
    (0 .. num_windows-1); `skip`: leading targets of the window already counted by another."""
    if num_windows <= 0:
        return []
    last = num_windows - 1
    count = last // block_size + 1
    windows = [(k * block_size, 0) for k in range(count)]
    covered = count * block_size  # targets 1 .. covered are counted
    total = last + block_size     # targets 1 .. total exist
    if covered < total:
        windows.append((last, covered - last))
    return windows


def chosen_windows(num_windows: int, block_size: int, eval_batches: int, batch_size: int) -> list[tuple[int, int]]:
    """The windows one evaluation reads (see the module's docstring)."""
    windows = tiled_windows(num_windows, block_size)
    if eval_batches > 0 and eval_batches * batch_size < len(windows):
        wanted = eval_batches * batch_size
        windows = [windows[j * len(windows) // wanted] for j in range(wanted)]
    return windows


def rank_batches(windows: list[tuple[int, int]], dp: int, dp_rank: int, batch_size: int,
                 block_size: int) -> list[list[tuple[int, int]]]:
    """This data-parallel rank's share of `windows`, cut into batches; every rank gets the same
    number of batches, padded with windows that count nothing (skip = block_size)."""
    mine = windows[dp_rank::dp]
    batches_per_rank = math.ceil(math.ceil(len(windows) / dp) / batch_size) if windows else 0
    padding = (0, block_size)
    mine = mine + [padding] * (batches_per_rank * batch_size - len(mine))
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
