"""A script that makes and destroys its own gloo group, with a plain `.then` callback that gloo's
thread releases slowly after the script's last collective (a thread starved of CPU on a loaded
machine, made deterministic by a busy wait). argv[1]: 'triax' starts it the way
`python -m triax.ddp_boost` does (triax imported, the group still the script's own), 'plain'
without triax. tests/test_exit_teardown.py expects 'triax' to exit 0 and 'plain' to abort.
"""

import sys
import threading
import time

if sys.argv[1] == "triax":
    import triax.ddp_boost  # noqa: F401

import torch
import torch.distributed as dist

BUSY_SECONDS = 0.5  # well under triax's settle limit (2 s), far over the time the main thread needs to exit

dist.init_process_group("gloo")
rank = dist.get_rank()


class BusyRelease:
    def __del__(self):
        if threading.current_thread() is not threading.main_thread():
            end = time.monotonic() + BUSY_SECONDS
            while time.monotonic() < end:  # runnable all along, as a thread waiting for a CPU is
                pass
        print(f"rank {rank}: callback released", flush=True)


def make_callback():
    held = BusyRelease()  # only the callback refers to it: whoever drops the callback releases it

    def callback(future):
        assert held is not None
        return future.value()[0]

    return callback


if rank == 1:
    time.sleep(0.2)  # rank 0's all-reduce completes on gloo's thread, after its callback is attached
future = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(make_callback())
future.wait()
group = dist.group.WORLD  # still referenced after destroy_process_group, as a DDP model's reducer keeps it
dist.destroy_process_group()
