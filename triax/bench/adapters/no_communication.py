"""The hand-written DDP step with a communication hook that sends nothing.

Timed beside the real step, it gives the share of the step spent on gradient communication that
backward does not hide: 1 - time(no communication) / time(DDP). DDP's bucketing and hook
machinery still run, so only the transfer and the wait for it are left out.
"""

from __future__ import annotations

import torch

from triax.bench.adapters import StepSetup, Unavailable
from triax.bench.adapters import plain_ddp


def keep_local_gradients(state, bucket):
    # (No annotations: DDP inspects them.) Hands the unreduced bucket straight back.
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def make_step(setup: StepSetup):
    if setup.world_size == 1:
        raise Unavailable("one process sends nothing")
    return plain_ddp.make_step(setup, communication_hook=keep_local_gradients)
