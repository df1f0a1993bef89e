"""`triax doctor --gpu-suite`: the whole GPU acceptance in one command, one table, one JSON report.

A GPU is often lent for minutes, not hours, so everything that needs one runs from this one
prepared command, each part within its share of a time budget (8 minutes by default):

1. the `gpu`-marked tests (mixed precision against fp32, a snapshot resumed bitwise with the CUDA
   RNG, Pipe on CUDA devices, the Accelerator's fp16/bf16, the Horovod door on NCCL);
2. the dense bf16 matmul rate against the data-sheet peak;
3. GPT-2 124M and a ~125M Llama: `triax train`'s tokens/s and MFU, from its own logs, beside a
   minimal hand-written loop of the same model (bf16, compiled blocks, fused AdamW, SDPA's flash
   kernel, the largest micro-batch that fits), and their ratio;
4. the largest micro-batch that fits, measured, against `triax plan`'s estimate;
5. a snapshot's write time and the pause it causes, synchronous and in the background.

Without a GPU it runs to its end all the same: the tests skip, and the measurements run on a tiny
shape (so the code paths and the report are exercised); each such check says it needs a GPU.
The report's schema is `SCHEMA` below; tests/unit/bench/test_gpu_suite.py holds it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from triax import safe_files
from triax.bench import gpu_bench
from triax.version import __version__

SCHEMA = "triax.gpu-suite/1"
STATUSES = ("ok", "warning", "failed", "skipped")
# The targets of the GPU acceptance (issue text): MFU of GPT-2 124M on one H100-class GPU, and the
# trainer's tokens/s against the hand-written loop's.
TARGET_MFU = 0.50
TARGET_RATIO = 0.98
# Each part's share of the budget, in the order they run; what a part leaves unused passes on.
SHARES = {"gpu tests": 0.33, "matmul": 0.02, "gpt2-124m": 0.26, "llama-125m": 0.21, "largest batch": 0.02,
          "snapshot": 0.08, "profile": 0.08}
# Less time left than this, and a part is not started: none of them finishes in less.
MIN_PART_S = 10.0
NEEDS_GPU = "needs a GPU (none is visible: torch.cuda.is_available() is False)"


class Suite:
    def __init__(self, budget_s: float, work_dir: str, device: torch.device, tests_dir: str | None):
        self.budget_s, self.work_dir, self.device, self.tests_dir = budget_s, work_dir, device, tests_dir
        self.started = time.monotonic()
        self.checks: list[dict] = []
        self.trainers: dict = {}

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def add(self, name: str, status: str, figure: str, advice: str = "", seconds: float = 0.0, **detail: Any) -> dict:
        assert status in STATUSES, status
        check = {"name": name, "status": status, "figure": figure, "advice": advice,
                 "seconds": round(seconds, 2), "needs_gpu": name not in ("environment",), "detail": detail}
        self.checks.append(check)
        print(f"  {status:8s} {name:22s} {figure}" + (f"  ({advice})" if advice and status != "ok" else ""),
              flush=True)
        return check

    def run(self, name: str, part: Callable[[float], None]) -> None:
        """One part, timed, within what the budget has left; an exception is a failed check with its
        traceback in the report, and the suite goes on."""
        share = SHARES.get(name, 0.0) * self.budget_s
        if self.left() < max(share, MIN_PART_S):
            self.add(name, "skipped", f"{self.left():.0f} s of the budget left", "raise --budget to run it")
            return
        started = time.monotonic()
        try:
            part(started + share)  # the part's deadline: its share of the budget (the tests' timeout)
        except Exception as error:  # reported, never raised: the other parts still run
            self.add(name, "failed", f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}",
                     "see the traceback in the report", time.monotonic() - started,
                     traceback=traceback.format_exc()[-4000:])
        if self.gpu:
            torch.cuda.empty_cache()


# ---- the parts ---------------------------------------------------------------------------------


def environment(suite: Suite) -> None:
    detail = {"python": platform.python_version(), "torch": torch.__version__, "triax": __version__,
              "cuda": torch.version.cuda, "device": str(suite.device)}
    if suite.gpu:
        props = torch.cuda.get_device_properties(suite.device)
        detail.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                      memory_gb=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                      nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
                      bf16=torch.cuda.is_bf16_supported())
        figure = f"{props.name}, CUDA {torch.version.cuda}, torch {torch.__version__}"
    else:
        figure = f"no GPU; torch {torch.__version__} on {platform.machine()}"
    suite.checks.append({"name": "environment", "status": "ok", "figure": figure, "advice": "", "seconds": 0.0,
                         "needs_gpu": False, "detail": detail})
    print(f"  {'ok':8s} {'environment':22s} {figure}", flush=True)


def gpu_tests(suite: Suite, deadline: float) -> None:
    started = time.monotonic()
    if suite.tests_dir is None:
        suite.add("gpu tests", "skipped", "no tests/ folder beside triax (an installed package)",
                  "run from a source checkout to include the gpu tests")
        return
    report = os.path.join(suite.work_dir, "gpu-tests.xml")
    root = os.path.dirname(suite.tests_dir)
    # Only the files that hold gpu tests: collecting the whole suite imports every optional package.
    files = gpu_test_files(suite.tests_dir)
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={report}", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    timeout = max(deadline - time.monotonic(), 30.0)
    try:
        result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        suite.add("gpu tests", "failed", f"did not finish in {timeout:.0f} s", "run them alone: pytest -m gpu",
                  time.monotonic() - started, output=output[-4000:])
        return
    counts, failures = read_junit(report)
    seconds = time.monotonic() - started
    figure = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if counts["failed"] or counts["errors"] or (result.returncode not in (0, 5) and not counts["passed"]):
        suite.add("gpu tests", "failed", figure + (f", {counts['errors']} errors" if counts["errors"] else ""),
                  "pytest -m gpu -x shows the first", seconds, failures=failures, counts=counts, output=output[-4000:])
    elif not suite.gpu:
        suite.add("gpu tests", "skipped", figure, NEEDS_GPU, seconds, counts=counts)
    else:
        suite.add("gpu tests", "ok", figure, "", seconds, counts=counts)


def gpu_test_files(tests_dir: str) -> list[str]:
    """The test files that mark a test `gpu`, in every folder under `tests_dir` (unit/<package>/, e2e/)."""
    found = []
    for directory, folders, names in os.walk(tests_dir):
        folders.sort()
        for name in sorted(names):
            path = os.path.join(directory, name)
            if name.startswith("test_") and name.endswith(".py"):
                with open(path, encoding="utf-8") as handle:
                    if "mark.gpu" in handle.read():
                        found.append(path)
    return sorted(found)


def read_junit(path: str) -> tuple[dict, list[dict]]:
    """pytest's JUnit XML: counts by outcome and each failure's test and message."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures: list[dict] = []
    if not os.path.isfile(path):
        return counts, failures
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                failures.append({"test": name, "message": (child.get("message") or "")[:500],
                                 "text": (child.text or "")[-2000:]})
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
    return counts, failures


def matmul(suite: Suite, deadline: float) -> None:
    started = time.monotonic()
    size = 8192 if suite.gpu else 512
    a = torch.randn(size, size, device=suite.device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=suite.device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    gpu_bench.synchronize(suite.device)
    rounds, timed = 10, time.perf_counter()
    for _ in range(rounds):
        a @ b
    gpu_bench.synchronize(suite.device)
    rate = 2 * size ** 3 * rounds / (time.perf_counter() - timed)
    peak = gpu_bench.peak_flops(suite.device, torch.bfloat16)
    figure = f"{rate / 1e12:.1f} TFLOP/s bf16 ({size}^3)"
    if peak is None:
        suite.add("matmul", "skipped" if not suite.gpu else "warning",
                  figure, NEEDS_GPU if not suite.gpu else "this GPU is not in triax's data-sheet table (triax/tracking/throughput.py)",
                  time.monotonic() - started, tflops=round(rate / 1e12, 2))
        return
    suite.add("matmul", "ok", f"{figure}, {100 * rate / peak:.0f}% of the data sheet's {peak / 1e12:.0f}", "",
              time.monotonic() - started, tflops=round(rate / 1e12, 2), peak_tflops=round(peak / 1e12, 1))


def throughput(suite: Suite, shape: gpu_bench.BenchShape, name: str, deadline: float, batch_cap: int,
               compile_blocks: bool = True) -> None:
    """The trainer against the hand-written loop on `shape`, at the largest micro-batch that fits."""
    started = time.monotonic()
    data_dir = gpu_bench.write_token_files(os.path.join(suite.work_dir, f"{name}-tokens"), shape.vocab_size,
                                           4_000_000 if suite.gpu else 50_000)
    if suite.gpu:
        fit = gpu_bench.largest_batch(shape, suite.device, data_dir, cap=batch_cap)
        batch = fit["batch_size"]
    else:
        fit, batch = None, 8
    run_dir = os.path.join(suite.work_dir, f"{name}-run")
    window = 10 if suite.gpu else 3
    with gpu_bench.flash_attention_only(suite.device):
        hand_first = gpu_bench.handwritten_figures(shape, batch, suite.device, data_dir, steps=window, warmup=3,
                                                   compile_blocks=compile_blocks)
        trainer, kept = gpu_bench.trainer_figures(shape, batch, suite.device, data_dir, run_dir, windows=4, window=window,
                                                  compile_blocks=compile_blocks)
        hand_second = gpu_bench.handwritten_figures(shape, batch, suite.device, data_dir, steps=window, warmup=3,
                                                    compile_blocks=compile_blocks)
    suite.trainers[name] = kept
    # Hand-written, trainer, hand-written: load or clock drift falls on both sides of the trainer.
    hand_tokens = (hand_first["tokens_per_s"] + hand_second["tokens_per_s"]) / 2
    ratio = trainer["tokens_per_s"] / hand_tokens
    detail = {"batch_size": batch, "block_size": shape.block_size, "trainer": trainer,
              "handwritten": [hand_first, hand_second], "ratio": round(ratio, 4), "fit": fit,
              "settings": f"bf16 autocast, fp32 weights, {'compiled' if compile_blocks else 'eager'} blocks, "
                          "fused AdamW, SDPA flash, grad clip 1.0"}
    figure = f"{trainer['tokens_per_s']:,.0f} tok/s, hand-written {hand_tokens:,.0f} (ratio {ratio:.3f})"
    if trainer["mfu"] is not None:
        figure += f", MFU {100 * trainer['mfu']:.1f}%"
    seconds = time.monotonic() - started
    if not suite.gpu:
        suite.add(name, "skipped", figure + " on the smoke shape", NEEDS_GPU, seconds, **detail)
        return
    short = []
    if ratio < TARGET_RATIO:
        short.append(f"ratio below {TARGET_RATIO}")
    if name == "gpt2-124m" and (trainer["mfu"] or 0) < TARGET_MFU:
        short.append(f"MFU below {100 * TARGET_MFU:.0f}%")
    suite.add(name, "warning" if short else "ok", figure,
              "; ".join(short) + ": profile with torch.profiler" if short else "", seconds, **detail)


def largest_batch_check(suite: Suite, deadline: float) -> None:
    fits = {name: check["detail"].get("fit") for name in ("gpt2-124m", "llama-125m")
            for check in suite.checks if check["name"] == name and check["detail"].get("fit")}
    if not suite.gpu:
        suite.add("largest batch", "skipped", "measured on a GPU only (each size is tried on the device)", NEEDS_GPU)
        return
    if not fits:
        suite.add("largest batch", "skipped", "the throughput checks did not run", "see their lines")
        return
    parts = [f"{name}: {fit['batch_size']} (x{suite_block(suite, name)} tokens, {fit['peak_mem_gb']} GiB), "
             f"plan predicts {fit['plan_max']} against {fit['predicted_max']} measured" for name, fit in fits.items()]
    suite.add("largest batch", "ok", "; ".join(parts), "", 0.0, **fits)


def suite_block(suite: Suite, name: str) -> int:
    return next(check["detail"]["block_size"] for check in suite.checks if check["name"] == name)


def snapshot_check(suite: Suite, deadline: float) -> None:
    started = time.monotonic()
    trainer = suite.trainers.get("gpt2-124m") or suite.trainers.get("llama-125m")
    if trainer is None:
        suite.add("snapshot", "skipped", "no trained model to snapshot (the throughput checks did not run)")
        return
    with gpu_bench.flash_attention_only(suite.device):
        figures = gpu_bench.snapshot_figures(trainer)
    sync, background = figures["sync"], figures["async"]
    figure = (f"{figures['snapshot_gb']} GiB: sync {sync['write_s']} s; async pauses the loop "
              f"{background['loop_pause_s']} s, written in {background['write_s']} s (steps "
              f"{background['step_s_while_writing']} s while writing, {figures['step_s']} s without)")
    suite.add("snapshot", "ok" if suite.gpu else "skipped", figure, "" if suite.gpu else NEEDS_GPU,
              time.monotonic() - started, **figures)


def profile_check(suite: Suite, deadline: float) -> None:
    """Where the trainer's step spends its GPU time: a few steps under torch.profiler, the kernels
    that take the most, and how much of the wall time the GPU was busy."""
    started = time.monotonic()
    trainer = suite.trainers.get("gpt2-124m")
    if trainer is None or not suite.gpu:
        suite.add("profile", "skipped", "profiles the GPT-2 step on a GPU", NEEDS_GPU if not suite.gpu else "")
        return
    with gpu_bench.flash_attention_only(suite.device):
        gpu_bench.timed_steps(trainer, 2)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = gpu_bench.timed_steps(trainer, 3) * 3
    events = [event for event in prof.key_averages() if getattr(event, "self_device_time_total", 0) > 0]
    events.sort(key=lambda event: event.self_device_time_total, reverse=True)
    # The kernels alone: an operator's row repeats the time of the kernels it launched.
    busy = sum(event.self_device_time_total for event in events
               if str(getattr(event, "device_type", "")).endswith("CUDA")) / 1e6
    top = [{"name": event.key[:120], "gpu_ms": round(event.self_device_time_total / 1e3 / 3, 3),
            "calls_per_step": event.count / 3} for event in events[:20]]
    share = busy / max(wall, 1e-9)
    suite.add("profile", "ok", f"GPU busy {100 * share:.0f}% of the step; most: {top[0]['name'] if top else '-'}",
              "", time.monotonic() - started, step_s=round(wall / 3, 4), gpu_busy_share=round(share, 3), top=top)


# ---- the command ---------------------------------------------------------------------------------


def source_tests_dir() -> str | None:
    """The tests/ folder of the checkout triax runs from, if it is one."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    candidate = os.path.join(here, "tests")
    return candidate if os.path.isfile(os.path.join(candidate, "conftest.py")) else None


def is_suite_report(path: str) -> bool:
    """Whether `path` is a regular file (not a link) holding a report this suite wrote."""
    try:
        value = safe_files.read_json(path, max_bytes=16 * 2**20)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(value, dict) and value.get("schema") == SCHEMA


def run(args: argparse.Namespace) -> int:
    """The suite, for `triax doctor --gpu-suite`'s checked options (triax.commands.doctor); exit code
    1 when a check failed."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    skip = set(filter(None, args.skip.split(",")))
    report_path = os.path.abspath(args.json)
    safe_files.make_directory(os.path.dirname(report_path))
    work_dir = tempfile.mkdtemp(prefix="triax-gpu-suite-")
    suite = Suite(args.budget, work_dir, device, source_tests_dir())
    print(f"triax doctor --gpu-suite: budget {args.budget:.0f} s on {device}; report {report_path}", flush=True)
    big = device.type == "cuda"
    parts = {
        "gpu tests": lambda deadline: gpu_tests(suite, deadline),
        "matmul": lambda deadline: matmul(suite, deadline),
        "gpt2-124m": lambda deadline: throughput(suite, gpu_bench.GPT2_124M if big else gpu_bench.SMOKE_GPT,
                                                 "gpt2-124m", deadline, args.batch_cap, not args.no_compile),
        "llama-125m": lambda deadline: throughput(suite, gpu_bench.LLAMA_125M if big else gpu_bench.SMOKE_LLAMA,
                                                  "llama-125m", deadline, args.batch_cap, not args.no_compile),
        "largest batch": lambda deadline: largest_batch_check(suite, deadline),
        "snapshot": lambda deadline: snapshot_check(suite, deadline),
        "profile": lambda deadline: profile_check(suite, deadline),
    }
    try:
        environment(suite)
        for name, part in parts.items():
            if name in skip:
                suite.add(name, "skipped", "left out by --skip")
                continue
            suite.run(name, part)
    finally:
        suite.trainers.clear()
        report = make_report(suite, args)
        safe_files.write_atomic(report_path, (json.dumps(report, indent=2) + "\n").encode())
        shutil.rmtree(work_dir, ignore_errors=True)
    print(f"{report['summary']}; {report['seconds']:.0f} s of {args.budget:.0f}; report {report_path}", flush=True)
    return 1 if report["failed"] else 0


def make_report(suite: Suite, args: argparse.Namespace) -> dict:
    counts = {status: sum(check["status"] == status for check in suite.checks) for status in STATUSES}
    return {"schema": SCHEMA, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - suite.started, 1), "budget_s": args.budget,
            "device": str(suite.device), "gpu": suite.gpu,
            "targets": {"gpt2_124m_mfu": TARGET_MFU, "trainer_over_handwritten": TARGET_RATIO},
            "checks": suite.checks, "failed": counts["failed"] > 0,
            "summary": ", ".join(f"{counts[status]} {status}" for status in STATUSES)}

