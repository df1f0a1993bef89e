"""Throughput, MFU, memory, and where they are written: console, progress bar, and the run's trackers."""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any, Callable, Sequence

import torch

from triax import safe_files
from triax.errors import printable
from triax.tracking.trackers import open_tracker

# Dense (no sparsity) peak FLOP/s of one GPU per precision, from NVIDIA's data sheets (their tensor
# core figures "with sparsity" are twice these). tf32 is what float32 matmuls run at when PyTorch
# allows TF32 (torch.set_float32_matmul_precision("high")); otherwise float32 is the fp32 figure.
# Matched in order against torch.cuda.get_device_name (e.g. "NVIDIA H100 80GB HBM3").
GPU_PEAK_FLOPS = [
    # H100 SXM5 / H100 NVL data sheet: BF16 & FP16 tensor 1,979* / 1,671*, TF32 989* / 835*, FP32 67 / 60 TFLOPS
    (r"\bH100\b.*\bNVL\b", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    # H100 PCIe data sheet: BF16 & FP16 tensor 1,513*, TF32 756*, FP32 51 TFLOPS
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12}),
    (r"\bH100\b", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12}),
    # H200 SXM / H200 NVL data sheet: the H100's figures (same GH100 compute, more memory)
    (r"\bH200\b.*\bNVL\b", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH200\b", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12}),
    # A100 data sheet (SXM and PCIe, 40 and 80 GB): BF16 & FP16 tensor 312, TF32 156, FP32 19.5 TFLOPS
    (r"\bA100\b", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    # L40S data sheet: BF16 & FP16 tensor 362.05 (733*), TF32 183 (366*), FP32 91.6 TFLOPS
    (r"\bL40S\b", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    # L4 data sheet: BF16 & FP16 tensor 242*, TF32 120*, FP32 30.3 TFLOPS
    (r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    # A10 data sheet: BF16 & FP16 tensor 125 (250*), TF32 62.5 (125*), FP32 31.2 TFLOPS
    (r"\bA10\b", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    # V100 data sheet (SXM2 / PCIe): FP16 tensor 125 / 112, FP32 15.7 / 14 TFLOPS; no bf16, no tf32
    (r"\bV100\b.*\bPCIE\b", {"fp16": 112e12, "fp32": 14e12}),
    (r"\bV100\b", {"fp16": 125e12, "fp32": 15.7e12}),
    # Ada and Ampere whitepapers, FP32 accumulate: RTX 4090 BF16/FP16 165.2, TF32 82.6, FP32 82.6;
    # RTX 3090 BF16/FP16 71, TF32 35.6, FP32 35.6 TFLOPS
    (r"RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    (r"RTX 3090", {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
]


def precision_name(dtype: torch.dtype) -> str:
    """The data-sheet column a matmul in `dtype` runs at (float32: tf32 when PyTorch allows it)."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """The data-sheet dense peak of the GPU called `name` for `dtype`; None if not in the table."""
    for pattern, peaks in GPU_PEAK_FLOPS:
        if re.search(pattern, name):
            return peaks.get(precision_name(dtype))
    return None


def table_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda":
        return None
    return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)


def stated_peak_flops(device: torch.device, dtype: torch.dtype, given: float | None) -> tuple[float, str] | None:
    """(the peak MFU is reported against, where it comes from): the user's, else a known GPU's data
    sheet, else None: no MFU. Never a peak measured at start-up, which varied 5x between two
    starts of one run on a shared CPU and so made MFU a figure of the machine's load."""
    if given is not None:
        return given, "trainer.peak_flops"
    value = table_peak_flops(device, dtype)
    if value is not None:
        return value, f"data sheet: {torch.cuda.get_device_name(device)} {precision_name(dtype)}"
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
    """(peak FLOP/s, where the figure comes from): the data-sheet table for known GPUs, else a
    measured matmul peak, labelled 'measured' (for benchmarks, which compare runs side by side on
    one machine; the trainer reports MFU against a stated peak only: stated_peak_flops)."""
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


def step_count(count: int) -> str:
    """'1 step', '2 steps'."""
    return f"{count} step{'s' if count != 1 else ''}"


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Pace:
    """A run's tokens/s and time left, computed here only: the progress bar and the log line show
    these same figures (each once computed its own, and a person saw '41s left' beside the bar's
    '02:55', and 1,437 tok/s of the last step beside the line's 466 of its interval).

    tokens/s is over the current log interval (reset by `new_interval`: the line's figure, also
    in metrics.jsonl); the time left is the steps to go at this session's pace so far, evaluations
    and snapshots included, which is what the rest of the run will also spend its time on."""

    def __init__(self, tokens_per_step: int, total_steps: int, step: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.tokens_per_step, self.total_steps, self.clock = tokens_per_step, total_steps, clock
        self.session_start = self.interval_start = clock()
        self.first_step = self.step = self.interval_first = step
        self.now = self.session_start

    def update(self, step: int) -> None:
        """The run reached `step` now."""
        self.step, self.now = step, self.clock()

    def new_interval(self) -> None:
        self.interval_start, self.interval_first = self.clock(), self.step

    @property
    def interval_steps(self) -> int:
        return self.step - self.interval_first

    @property
    def interval_seconds(self) -> float:
        return self.now - self.interval_start

    @property
    def tokens_per_s(self) -> float:
        return self.interval_steps * self.tokens_per_step / max(self.interval_seconds, 1e-9)

    @property
    def seconds(self) -> float:
        """Since the session started."""
        return self.now - self.session_start

    @property
    def session_steps(self) -> int:
        return self.step - self.first_step

    @property
    def time_left(self) -> str:
        return duration(self.seconds / max(self.session_steps, 1) * (self.total_steps - self.step))

    @staticmethod
    def rate(tokens_per_s: float) -> str:
        return f"{tokens_per_s:,.0f} tok/s"


class MetricsLogger:
    """Writes one record per logged step to the run's trackers (triax.tracking.trackers: metrics.jsonl,
    TensorBoard, W&B, MLflow) and prints the console line. Only the main process creates one with
    enabled=True; the others get a silent logger so call sites need no rank checks."""

    def __init__(self, run_dir: str | None, enabled: bool,
                 loggers: Sequence[str] = ("tensorboard", "jsonl"), progress: bool | None = None,
                 project: str = "triax", run_name: str | None = None, config: dict | None = None):
        self.enabled = enabled and run_dir is not None
        self.output_closed = False  # stdout's reader went away (`triax train | head`)
        self.on_output_closed = None  # the trainer's: stop after this step, as Ctrl-C does
        self.trackers: list = []
        self._bar = None
        self._progress = False
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
        self._progress = sys.stderr.isatty() if progress is None else progress

    def start_progress(self, total_steps: int, step: int) -> None:
        """A progress bar (on a terminal only) from `step` (a resumed run's) to `total_steps`: steps
        done, time spent, and the postfix `advance` gives (loss, tokens/s, time left: a Pace's)."""
        if self.enabled and self._progress and total_steps:
            from tqdm import tqdm  # deferred: only a terminal shows a bar

            # tqdm's own rate and time left are left out: the postfix carries the run's (Pace).
            self._bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, leave=False,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def advance(self, steps: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            if postfix:  # before the update, which draws it: the bar shows this step's figures
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(steps)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        # Names in it come from configs and files, samples from the data: nothing reaches the
        # terminal raw but line breaks and tabs.
        message = printable(message, keep="\n\t")
        if self.output_closed:  # what is left to say (where the snapshot is) goes to stderr
            print(message, file=sys.stderr, flush=True)
            return
        try:
            if self._bar is not None:
                self._bar.write(message)
            else:
                print(message, flush=True)
        except BrokenPipeError:
            self._close_output()

    def _close_output(self) -> None:
        """stdout is a pipe whose reader ended (`| head -3`): later writes, and Python's own flush at
        exit, go to /dev/null instead of raising BrokenPipeError; the run stops as Ctrl-C stops it."""
        self.output_closed = True
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        if self.on_output_closed is not None:
            self.on_output_closed()

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
