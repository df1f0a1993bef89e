"""One thread per partition, fed through a queue.

PyTorch releases the GIL inside its kernels (and CUDA launches are asynchronous), so threads are
enough to keep every device busy at once; no extra processes are needed for a single-process pipe.

Grad mode, autocast and inference mode are thread-local in PyTorch: a worker thread would otherwise
run with the defaults, whatever the caller asked for. `capture_caller_state` copies them over.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable

import torch

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def capture_caller_state() -> Callable[[], contextlib.AbstractContextManager]:
    """Remember the calling thread's autograd and autocast modes; return a context that restores them."""
    grad_enabled = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocasts = [(device_type, torch.get_autocast_dtype(device_type))
                 for device_type in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(device_type)]

    @contextlib.contextmanager
    def restore():
        with contextlib.ExitStack() as stack:
            if inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(grad_enabled))
            for device_type, dtype in autocasts:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            yield

    return restore


class Worker:
    """A thread that runs the tasks put on its queue, in order, and queues their results."""

    def __init__(self, name: str, setup: Callable[[], None] | None = None):
        self._tasks: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._setup = setup
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._setup is not None:
            self._setup()
        while True:
            task = self._tasks.get()
            if task is None:
                return
            try:
                self._results.put((True, task()))
            except BaseException as error:  # handed to the caller, who re-raises it
                self._results.put((False, error))

    def submit(self, task: Callable) -> None:
        self._tasks.put(task)

    def result(self):
        """Wait for the oldest unfinished task: (True, value) or (False, exception)."""
        return self._results.get()

    def stop(self) -> None:
        self._tasks.put(None)
        self._thread.join()


@contextlib.contextmanager
def spawn_workers(devices: list[torch.device], name: str = "triax-pipe"):
    """Start one worker per device entry for the duration of one forward pass; always stop them.

    Partitions on the CPU share its cores. Left alone, each worker thread would start a full team of
    intra-op threads (one per core) and the teams would fight over the cores, several times slower
    than one thread; so each CPU worker gets an equal share of the caller's intra-op threads.
    """
    caller_threads = torch.get_num_threads()
    cpu_workers = sum(device.type == "cpu" for device in devices)
    share = max(1, caller_threads // max(cpu_workers, 1))
    setup = (lambda: torch.set_num_threads(share)) if cpu_workers > 1 else None
    workers = [Worker(f"{name}-{index}", setup if device.type == "cpu" else None)
               for index, device in enumerate(devices)]
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()
        if setup is not None:
            # torch.set_num_threads also sets process-wide defaults (MKL's, and those of threads started
            # later); put back what the caller had, for its backward pass and for later threads.
            torch.set_num_threads(caller_threads)
