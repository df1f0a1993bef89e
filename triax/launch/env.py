"""What a bug report needs (`triax env`: triax.commands.env) — versions, devices, CPU bf16 support,
active config."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def collect() -> dict:
    import torch
    import torch.distributed as dist

    from triax.version import __version__
    from triax.launch.config import config_path, load_config

    flags = cpu_flags()
    info = {
        "triax": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda (torch built with)": torch.version.cuda or "none (CPU build)",
        "cuda available": torch.cuda.is_available(),
        "cpu": platform.processor() or platform.machine(),
        "cpu cores": os.cpu_count(),
        "cpu capability (torch)": torch.backends.cpu.get_cpu_capability(),
        # Native bf16 matrix instructions make bf16 several times faster than fp32 on CPU;
        # without them bf16 is emulated and usually slower.
        "cpu bf16 instructions": ", ".join(sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})) or "none",
        "distributed backends": ", ".join(name for name, ok in (
            ("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available())) if ok) or "none",
    }
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
        info["cudnn"] = torch.backends.cudnn.version()
        info["gpus"] = [f"{i}: {torch.cuda.get_device_name(i)}, "
                        f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB"
                        for i in range(torch.cuda.device_count())]
        info["gpu bf16"] = torch.cuda.is_bf16_supported()
    path = config_path()
    try:
        config = load_config(path)
        info["config file"] = path if config else f"{path} (not written yet: run `triax config`)"
        info["config"] = dataclasses.asdict(config) if config else None
    except Exception as error:  # a broken config is exactly what a bug report should show
        info["config file"] = path
        info["config"] = f"unreadable: {error}"
    info["environment"] = {key: value for key, value in sorted(os.environ.items())
                           if key.startswith(("TRIAX_", "OMP_", "MASTER_", "NCCL_", "GLOO_", "CUDA_VISIBLE"))}
    return info
