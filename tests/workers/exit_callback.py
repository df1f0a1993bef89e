"""An all-reduce whose future carries a Python callback, at the very end of a script (gloo).

argv[1] is 'triax' (triax.parallel.comm_hooks.all_reduce_then, what triax's DDP hooks use) or
'plain' (PyTorch's `all_reduce(...).get_future().then(...)`). Gloo's worker thread releases the
callback only once this script has reached its exit handlers (and, for 'plain', only once the
interpreter is finalizing, which shows the abort deterministically); tests/test_comm_hooks.py
checks that the 'triax' script exits 0.
"""

import atexit
import sys
import threading
import time

import torch
import torch.distributed as dist

from triax.parallel.comm_hooks import all_reduce_then

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
exiting = threading.Event()
atexit.register(exiting.set)  # registered after triax's exit handler, so it runs before it


class SlowRelease:
    def __del__(self):
        if threading.current_thread() is not threading.main_thread():
            exiting.wait(timeout=10)  # released on gloo's thread: hold it until the script exits
            while sys.argv[1] == "plain" and not sys.is_finalizing():
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
if sys.argv[1] == "triax":
    future = all_reduce_then(tensor, dist.group.WORLD, make_callback())
else:
    future = dist.all_reduce(tensor, async_op=True).get_future().then(make_callback())
assert torch.equal(future.wait(), torch.full((4,), float(world)))
group = dist.group.WORLD  # still referenced after destroy_process_group, as a DDP model's reducer keeps it
dist.destroy_process_group()
