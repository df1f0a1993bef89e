"""Helpers for tests and benchmarks that start real processes.

Kept in the package (not under tests/) so benchmarks and the bench command can use them too.
"""

from __future__ import annotations

import os
import subprocess
import sys

from triax.runtime.rendezvous import free_port


def quiet_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: one thread each unless OMP_NUM_THREADS is set (tests run
    4 processes on 2 cores; setting it lets the suite be checked at other thread counts)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env.update(PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
    # Children import the same triax as this process, not whichever checkout pip installed.
    import triax

    source_root = os.path.dirname(os.path.dirname(os.path.abspath(triax.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def torchrun_command(nproc: int, args: list[str], max_restarts: int = 0) -> list[str]:
    """`python -m torch.distributed.run` on loopback with a fresh port, then `args`
    (a script path, or '-m', 'module', ...)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            f"--max-restarts={max_restarts}", *args]


def run(command: list[str], timeout: float = 300, env: dict[str, str] | None = None,
        cwd: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, capture its output, and on failure raise with that output attached."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=env or quiet_env(), cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(
            f"command failed with exit code {result.returncode}: {' '.join(command)}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
    return result


def run_torchrun(nproc: int, args: list[str], timeout: float = 300, max_restarts: int = 0,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    return run(torchrun_command(nproc, args, max_restarts), timeout=timeout, env=env, cwd=cwd,
               check=check)
