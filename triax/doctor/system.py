"""This process's own machine: versions, the device, what its kernels can do, how fast it
multiplies, and whether its memory holds the configured model. Every rank runs these."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from triax.doctor.needs import RunNeeds
from triax.doctor.report import FAILED, OK, SKIPPED, WARNING, Check, format_bytes
from triax.runtime.host_memory import host_memory_bytes
from triax.launch.env import cpu_flags
from triax.tracking.throughput import gpu_peak_flops, measure_peak_flops, precision_name
from triax.runtime.precision import Precision
from triax.runtime.threads import ThreadChoice
from triax.config import asynchronous_snapshots
from triax.version import __version__

if TYPE_CHECKING:
    from triax.config import TrainerConfig

SECTION = "system"
OPTIONAL_PACKAGES = ("transformers", "accelerate", "tokenizers", "safetensors", "hydra-core", "fsspec",
                     "tensorboard", "wandb", "mlflow-skinny", "torchdata")
# A matmul below this share of the data-sheet peak means a throttled, misconfigured or shared GPU:
# cuBLAS reaches 70-90% of the dense peak on large square bf16 matmuls on every listed GPU.
MATMUL_PEAK_SHARE = 0.5
# The estimate leaves out the runtime and allocator slack (plan.py's docstring): above this share of
# the memory a run is at risk of running out partway, when fragmentation grows.
MEMORY_SHARE = 0.9


def versions() -> Check:
    parts = {"python": sys.version.split()[0], "torch": torch.__version__, "triax": __version__,
             "cuda": torch.version.cuda or "none (CPU build)"}
    if torch.cuda.is_available():
        parts["driver"] = _driver_version()
        if torch.distributed.is_nccl_available():
            parts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    installed = {}
    for name in OPTIONAL_PACKAGES:
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    figure = ", ".join(f"{key} {value}" for key, value in parts.items())
    if installed:
        figure += "; " + ", ".join(f"{key} {value}" for key, value in installed.items())
    return Check("versions", OK, figure, section=SECTION, values={**parts, "packages": installed})


def _driver_version() -> str:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)
        return result.stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def device_check(device: torch.device, threads: ThreadChoice | None = None) -> Check:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        figure = (f"{device}: {properties.name}, {format_bytes(properties.total_memory)}, compute capability "
                  f"{properties.major}.{properties.minor}; {torch.cuda.device_count()} GPU(s) on this host")
        return Check("device", OK, figure, section=SECTION,
                     values={"name": properties.name, "memory_bytes": properties.total_memory})
    capability = torch.backends.cpu.get_cpu_capability()
    count = torch.get_num_threads()
    # The count triax's commands take here now (triax.runtime.threads), with why; else torch's as it stands.
    why = f"{threads.describe()}, as `triax train` would" if threads is not None else f"{count} thread(s) for torch"
    return Check("device", OK, f"cpu ({capability}), {why}", section=SECTION,
                 values={"name": "cpu", "capability": capability, "threads": count})


def precision_check(device: torch.device, precision: str) -> list[Check]:
    """bf16 and fp16 here, and whether the configured trainer.precision can run."""
    checks = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        works, why = _dtype_works(device, dtype)
        needed = name in precision
        if device.type == "cpu" and name == "fp16" and not needed:
            # The trainer's fp16 is autocast with loss scaling: a CUDA policy (triax/runtime/precision.py).
            checks.append(Check(name, SKIPPED, "not on a CPU: the trainer's fp16 (autocast + loss scaling) "
                                "needs CUDA; bf16 is the CPU's half precision", section=SECTION))
            continue
        if device.type == "cpu" and name == "fp16":
            works, why = False, "fp16 mixed precision needs CUDA"
        if works and device.type == "cpu" and name == "bf16":
            native = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
            why = ("native (" + ", ".join(native) + ")") if native else "emulated: no avx512_bf16/amx_bf16, often slower than fp32"
        status = OK if works else (FAILED if needed else WARNING if device.type == "cuda" else OK)
        figure = ("works" if works else "not available") + (f": {why}" if why else "")
        advice = (f"trainer.precision={precision} cannot run here; use trainer.precision=fp32"
                  + (" or bf16" if name == "fp16" and _dtype_works(device, torch.bfloat16)[0] else "")
                  if needed else "runs needing it will fail here")
        checks.append(Check(name, status, figure, advice, SECTION, values={"works": works}))
    return checks


def _dtype_works(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return False, "this GPU has no bf16"
    try:
        a = torch.ones(8, 8, device=device, dtype=dtype)
        return bool(torch.isfinite(a @ a).all()), ""
    except RuntimeError as error:
        return False, str(error).split("\n")[0]


def attention_checks(device: torch.device, dtype: torch.dtype) -> list[Check]:
    """Whether SDPA's fused kernels run here: without them attention falls back to the math kernel,
    which stores the whole score matrix (more memory, slower)."""
    checks = []
    shape = (1, 2, 64, 64)
    query = torch.randn(*shape, device=device, dtype=dtype)
    for backend, name in ((SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.EFFICIENT_ATTENTION, "memory-efficient")):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(query, query, query, is_causal=True)
            status, figure = OK, f"runs ({_dtype_label(dtype)}, {device.type})"
        except RuntimeError as error:
            status, figure = WARNING, f"not available ({_dtype_label(dtype)}, {device.type}): {str(error).split('.')[0]}"
        advice = "attention uses another kernel: more memory and time per step (a newer GPU or torch build has it)"
        if device.type == "cuda" and dtype == torch.float32:
            advice = "CUDA's fused attention kernels need bf16 or fp16: trainer.precision=bf16 uses them"
        checks.append(Check(f"SDPA {name}", status, figure, advice, SECTION, values={"works": status == OK}))
    if device.type == "cpu" and any(check.status == OK for check in checks):
        # PyTorch's CPU build has flash attention only: the memory-efficient kernel is CUDA's.
        for check in checks:
            if check.status == WARNING:
                check.status, check.figure = SKIPPED, check.figure + " (CUDA only; flash runs here)"
    return checks


def _dtype_label(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def compile_check(device: torch.device, needed: bool) -> Check:
    """A tiny torch.compile: the first compile pays for importing and warming the compiler, so this
    is also how long a run with parallel.compile=true waits before its first step, at least."""
    start = time.perf_counter()
    try:
        compiled = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)
        x = torch.randn(64, device=device)
        ok = torch.allclose(compiled(x), torch.nn.functional.gelu(x) * 2 + 1, atol=1e-5)
        figure = f"{'works' if ok else 'wrong result'} ({time.perf_counter() - start:.1f} s for a tiny function)"
    except Exception as error:  # any compiler failure (missing C compiler, triton) is the finding
        ok, figure = False, f"fails: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    status = OK if ok else (FAILED if needed else WARNING)
    advice = ("parallel.compile=true will fail; set parallel.compile=false, or install a C compiler "
              "(and triton on GPUs)" if needed else "parallel.compile=true would fail here")
    return Check("torch.compile", status, figure, advice, SECTION,
                 values={"works": ok, "seconds": time.perf_counter() - start})


def matmul_checks(device: torch.device, precision: str, seconds: float) -> list[Check]:
    """The dense matmul rate in each dtype the configured precision computes in, against the
    data-sheet peak of a known GPU (the trainer's MFU table), or on a CPU as a figure alone."""
    dtypes = [torch.float32] if precision == "fp32" else [Precision(precision).compute_dtype, torch.float32]
    checks = []
    for dtype in dtypes:
        measured = measure_peak_flops(device, dtype, seconds=seconds)
        name = f"matmul {precision_name(dtype)}"
        values = {"flops": measured}
        if device.type != "cuda":
            checks.append(Check(name, OK, f"{measured / 1e9:.1f} GFLOP/s (CPU: no data-sheet peak to compare)",
                                section=SECTION, values=values))
            continue
        gpu = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(gpu, dtype)
        if peak is None:
            checks.append(Check(name, OK, f"{measured / 1e12:.1f} TFLOP/s ({gpu} is not in the data-sheet table)",
                                section=SECTION, values=values))
            continue
        share = measured / peak
        values.update(peak_flops=peak, share=share)
        checks.append(Check(
            name, OK if share >= MATMUL_PEAK_SHARE else WARNING,
            f"{measured / 1e12:.1f} TFLOP/s, {100 * share:.0f}% of the {gpu} data sheet's {peak / 1e12:.0f}",
            "below half the data-sheet peak: look for throttling (nvidia-smi -q -d PERFORMANCE,CLOCK), "
            "another process on this GPU, or a power cap", SECTION, values=values))
    return checks


def memory_checks(device: torch.device, needs: RunNeeds, trainer: TrainerConfig, cpu_offload: bool,
                  local_world_size: int) -> list[Check]:
    """The memory the configured model needs per device (triax plan's estimate) against what there
    is: on a CPU the host's, shared by this host's processes; on a GPU the GPU's, and the host's for
    what a GPU run keeps there (host_bytes_per_gpu_process)."""
    needed = needs.per_device.total_gb * 2**30
    if device.type != "cuda":
        return [_against_host("memory", needed, "per device (triax plan's estimate, "
                              f"{needs.layout.describe()})", local_world_size)]
    free, total = torch.cuda.mem_get_info(device)
    checks = [_verdict("memory", needed, total, free, f"the run needs {format_bytes(needed)} per device (triax "
                       f"plan's estimate, {needs.layout.describe()}); {device}: {format_bytes(total)}, "
                       f"{format_bytes(free)} free")]
    host = host_bytes_per_gpu_process(needs, trainer, device, cpu_offload)
    if host:
        checks.append(_against_host("host memory", host, "per process on the host (snapshot staging copy "
                                    "and/or offloaded shards)", local_world_size))
    return checks


def host_bytes_per_gpu_process(needs: RunNeeds, trainer: TrainerConfig, device: torch.device, cpu_offload: bool) -> int:
    """Host memory a GPU process of the run holds: its model and optimizer shards, staged for an
    asynchronous snapshot (trainer.async_save, on by default with CUDA), and with
    parallel.cpu_offload its shards, gradients and optimizer state themselves."""
    estimate = needs.per_device
    staged = (estimate.params_gb + estimate.optimizer_gb) if asynchronous_snapshots(trainer, device) else 0.0
    offloaded = (estimate.params_gb + estimate.grads_gb + estimate.optimizer_gb) if cpu_offload else 0.0
    return int((staged + offloaded) * 2**30)


def _against_host(name: str, needed: float, what: str, local_world_size: int) -> Check:
    total, free = host_memory_bytes(), _available_host_memory()
    share = max(local_world_size, 1)
    if total is None:
        return Check(name, SKIPPED, "this system does not say how much memory it has", section="memory")
    total //= share
    free = free // share if free is not None else None
    where = "this host" if share == 1 else f"this host's {share} processes (each)"
    figure = (f"the run needs {format_bytes(needed)} {what}; {where}: {format_bytes(total)}"
              + (f", {format_bytes(free)} free" if free is not None else ""))
    return _verdict(name, needed, total, free, figure)


def _verdict(name: str, needed: float, total: int, free: int | None, figure: str) -> Check:
    values = {"needed_bytes": needed, "total_bytes": total, "free_bytes": free}
    if needed > total:
        return Check(name, FAILED, figure, "the run will not fit: shard the model (parallel.dp_shard), lower "
                     "trainer.batch_size or data.block_size, or set parallel.activation_checkpointing=full",
                     "memory", values=values)
    if needed > MEMORY_SHARE * total or (free is not None and needed > free):
        return Check(name, WARNING, figure, "little headroom (the estimate leaves out the runtime itself): "
                     "free memory here or lower the batch size", "memory", values=values)
    return Check(name, OK, figure, section="memory", values=values)


def _available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo: what can be allocated without swapping."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
