"""Throughput, MFU, memory, and where they are written: console, progress bar, and the run's trackers."""

from __future__ import annotations

import os
import sys
import time

import torch

from triax import safe_files
from triax.trackers import open_tracker

# Dense (no sparsity) peak tensor-core FLOP/s by GPU name fragment, for bf16/fp16 and for tf32
# (fp32 matmuls run as tf32 when allowed). Figures from the vendors' data sheets.
GPU_PEAK_FLOPS = {
    # name fragment: (bf16/fp16, tf32)
    "H200": (989e12, 494e12),
    "H100 PCIe": (756e12, 378e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "L4": (121e12, 60e12),
    "A10G": (70e12, 35e12),
    "A10": (125e12, 62.5e12),
    "V100": (125e12, 15.7e12),
    "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12),
}


def table_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (half, tf32) in GPU_PEAK_FLOPS.items():
        if fragment in name:
            return half if dtype in (torch.bfloat16, torch.float16) else tf32
    return None


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int | None = None,
                       seconds: float | None = None) -> float:
    """FLOP/s of a square matmul in `dtype` on `device`: the best of several timed repeats.

    On a CPU a 512-square matmul already reaches the large-matrix peak (within a few percent of
    1024-square ones), and 0.1 s gives it ~20 repeats: the run's start-up pays a third of what
    1024 for 0.3 s costs."""
    size = size or (4096 if device.type == "cuda" else 512)
    seconds = seconds if seconds is not None else (0.3 if device.type == "cuda" else 0.1)
    # A private generator: drawing from the global one would shift every later dropout mask, so a
    # run that measures at a different step (e.g. after a resume) would not replay bitwise.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b)
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from): the data-sheet table for known GPUs,
    else a measured matmul peak, labelled 'measured'."""
    value = table_peak_flops(device, dtype)
    if value is not None:
        return value, f"table:{torch.cuda.get_device_name(device)}"
    return measure_peak_flops(device, dtype), "measured"


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    # ru_maxrss is in KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MetricsLogger:
    """Writes one record per logged step to the run's trackers (triax.trackers: metrics.jsonl,
    TensorBoard, W&B, MLflow) and prints the console line. Only the main process creates one with
    enabled=True; the others get a silent logger so call sites need no rank checks."""

    def __init__(self, run_dir: str | None, enabled: bool, total_steps: int | None = None,
                 loggers=("tensorboard", "jsonl"), progress: bool | None = None, project: str = "triax",
                 run_name: str | None = None, config: dict | None = None):
        self.enabled = enabled and run_dir is not None
        self.trackers: list = []
        self._bar = None
        if not self.enabled:
            return
        safe_files.make_directory(run_dir)
        board_dir = os.path.join(run_dir, "tensorboard")
        if "tensorboard" in loggers and os.path.lexists(board_dir):
            safe_files.real_directory(board_dir)  # refused before metrics.jsonl is created
        try:
            # metrics.jsonl first: a refused one (a planted link) stops the run before anything is written.
            for name in sorted(loggers, key=lambda name: name != "jsonl"):
                self.trackers.append(open_tracker(name, run_dir, project, run_name))
                if config is not None:
                    self.trackers[-1].store_init_configuration(config)
        except BaseException:
            self.close()  # the ones opened so far (a W&B run left open would linger)
            raise
        if progress is None:
            progress = sys.stderr.isatty()
        if progress and total_steps:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=False)

    def advance(self, steps: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(steps)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def log(self, step: int, record: dict, console: str | None = None) -> None:
        if not self.enabled:
            return
        for tracker in self.trackers:
            tracker.log(record, step)
        if console:
            self.print(console)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()
