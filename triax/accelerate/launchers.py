"""notebook_launcher: run a training function in several processes on this machine (a notebook,
or any script that cannot go through `triax launch`). Each process joins the group through the
same environment variables torchrun sets, so the function's Accelerator works unchanged."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from triax.accelerate._internal.errors import AcceleratorRuntimeError, AcceleratorValueError, UnsupportedFeatureError
from triax.accelerate.state import AcceleratorState, GradientState, PartialState
from triax.launch import settings as launch_settings
from triax.runtime.rendezvous import free_port


__all__ = ["debug_launcher", "notebook_launcher", "test_launch"]


def _worker(local_rank: int, function: Callable, args: tuple, environment: dict) -> None:
    # Runs in the child: it is rank `local_rank` of this one-machine job. A forked child inherits
    # the parent's process state (a one-process PartialState, say); it is a new process of a new
    # job, so that state is forgotten and the function's Accelerator finds the job afresh.
    os.environ.update(environment)
    if environment["WORLD_SIZE"] != "1":  # one process alone is no distributed job (as Accelerate's launcher)
        os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    function(*args)


def notebook_launcher(function: Callable, args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str | int | None = None, master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, start_method: str | None = None,
                      **unsupported: Any) -> None:
    """Call `function(*args)` in `num_processes` processes (torch.multiprocessing), each with its
    rank in the environment; with num_processes None or 1, call it here. Raises when a process
    fails. start_method: "fork" (default on Linux/macOS, so functions defined in a notebook work)
    or "spawn" (the function must then be importable)."""
    if num_nodes != 1 or node_rank != 0:
        raise UnsupportedFeatureError("notebook_launcher runs on one machine; for several use "
                                      "`triax launch --num-machines N` (torchrun's rendezvous)")
    for name, value in unsupported.items():
        if value not in (None, "", 0, "static", "none", 0.1):
            raise UnsupportedFeatureError(f"notebook_launcher({name}={value!r}) is not supported; use "
                                          "`triax launch` for elastic or multi-machine runs")
    if mixed_precision not in launch_settings.PRECISION_POLICIES:
        raise AcceleratorValueError(f"notebook_launcher(mixed_precision={mixed_precision!r}); use no, fp16 or bf16")
    if num_processes is None or num_processes == 1:
        os.environ.setdefault(launch_settings.ENVIRONMENT["mixed_precision"], mixed_precision)
        function(*args)
        return
    if not isinstance(num_processes, int) or num_processes < 1:
        raise AcceleratorValueError(f"notebook_launcher(num_processes={num_processes!r}) must be a positive integer")
    _start("notebook_launcher", function, args, num_processes, master_addr, use_port, start_method,
           {launch_settings.ENVIRONMENT["mixed_precision"]: mixed_precision})


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Call `function(*args)` in `num_processes` CPU processes on this machine (forked, even for
    one), for trying distributed code without a GPU; raises when a process fails."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise AcceleratorValueError(f"debug_launcher(num_processes={num_processes!r}) must be a positive integer")
    # Accelerate's own launch variables too: code of Accelerate's that the function may call
    # (its state, its test scripts) then sees the CPU job Accelerate's debug_launcher makes.
    _start("debug_launcher", function, args, num_processes, "127.0.0.1", None, "fork",
           {launch_settings.ENVIRONMENT["mixed_precision"]: "no", launch_settings.ENVIRONMENT["use_cpu"]: "true",
            "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "yes"})


def test_launch() -> None:
    """Check that this process can set up its process state (PartialState)."""
    PartialState()


def _start(who: str, function: Callable, args: tuple, num_processes: int, master_addr: str, use_port: bool,
           start_method: str | None, settings: dict) -> None:
    """Run function(*args) in num_processes child processes of one job; wait for all of them."""
    import torch.distributed as dist
    import torch.multiprocessing as multiprocessing

    if dist.is_initialized():
        raise AcceleratorRuntimeError(f"{who} was called after a process group was created in this "
                                      "process (an Accelerator was made here?); restart the notebook kernel "
                                      f"and call {who} before creating one")
    port = int(use_port) if use_port not in (None, "") else free_port(master_addr)
    environment = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(num_processes),
                   "LOCAL_WORLD_SIZE": str(num_processes), **settings}
    method = start_method or ("spawn" if sys.platform == "win32" else "fork")
    try:
        multiprocessing.start_processes(_worker, args=(function, tuple(args), environment), nprocs=num_processes,
                                        join=True, start_method=method)
    except multiprocessing.ProcessRaisedException as error:
        raise AcceleratorRuntimeError(f"a process started by {who} failed: "
                                      f"{str(error).strip().splitlines()[-1]}") from error
    except multiprocessing.ProcessExitedException as error:
        raise AcceleratorRuntimeError(f"a process started by {who} exited with code "
                                      f"{error.exit_code}") from error
