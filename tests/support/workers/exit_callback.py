"""An all-reduce whose future carries a Python callback, at the very end of a script (gloo), and
gloo's worker thread releasing that callback late. argv[1]:

- 'triax': triax.parallel.comm_hooks.all_reduce_then (what triax's DDP hooks use); the release
  waits until the script has reached its exit handlers;
- 'plain': PyTorch's `all_reduce(...).get_future().then(...)`; the release waits until the
  interpreter is finalizing, which shows the abort deterministically;
- 'busy-triax' / 'busy-plain': PyTorch's plain `.then`, as PowerSGD's hook issues it, in a script
  that makes and destroys its own group, started the way `python -m triax.ddp_boost` starts it
  (triax imported) or without triax; the release is a busy wait of BUSY_SECONDS, a thread that
  waits for a CPU on a loaded machine.

tests/unit/train/test_comm_hooks.py and tests/e2e/test_exit_teardown.py expect the triax modes to exit 0 and the
plain ones to abort.
"""

import atexit
import sys
import threading
import time

mode = sys.argv[1]
if mode == "busy-triax":
    import triax.ddp_boost  # noqa: F401
elif mode == "triax":
    from triax.parallel.comm_hooks import all_reduce_then

import torch
import torch.distributed as dist

BUSY_SECONDS = 0.5  # under triax's settle limit (2 s), far over what the main thread needs to exit

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
exiting = threading.Event()
atexit.register(exiting.set)  # registered after triax's exit handler, so it runs before it


class SlowRelease:
    def __del__(self):
        if threading.current_thread() is not threading.main_thread():
            if mode.startswith("busy"):
                end = time.monotonic() + BUSY_SECONDS
                while time.monotonic() < end:  # runnable all along
                    pass
            else:
                exiting.wait(timeout=10)  # released on gloo's thread: hold it until the script exits
                while mode == "plain" and not sys.is_finalizing():
                    time.sleep(0.001)  # and without triax, on until the interpreter is finalizing
        print(f"rank {rank}: callback released", flush=True)


def make_callback():
    # Only the callback refers to `held`, so whoever drops the callback releases it.
    held = SlowRelease()

    def callback(future):
        assert held is not None
        return future.value()[0]

    return callback


if rank == 1:
    time.sleep(0.2)  # rank 0's all-reduce completes on gloo's thread, after its callback is attached
tensor = torch.ones(4)
if mode == "triax":
    future = all_reduce_then(tensor, dist.group.WORLD, make_callback())
else:
    future = dist.all_reduce(tensor, async_op=True).get_future().then(make_callback())
assert torch.equal(future.wait(), torch.full((4,), float(world)))
group = dist.group.WORLD  # still referenced after destroy_process_group, as a DDP model's reducer keeps it
dist.destroy_process_group()
