"""Ends without hvd.shutdown(), as Horovod's own scripts do. Registered before hvd.init(), the
report below runs after hvd.init()'s own exit handler (atexit runs last-registered first) and
prints whether the process group is still alive at that point. Started by test_horovod_api.py."""

import atexit

import torch
import torch.distributed as dist


@atexit.register
def report():
    print(f"process group alive at exit: {dist.is_initialized()}", flush=True)


import triax.horovod as hvd  # noqa: E402

hvd.init()
hvd.allreduce(torch.ones(3), name="last")
