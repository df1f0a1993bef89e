"""What DDP puts on the wire: gradient compression by PyTorch's DDP communication hooks.

Where the network, not the arithmetic, bounds the step (several machines on a slow link), sending
fewer bytes per gradient is the speed-up. triax does not write its own collectives for this; it
picks one of the hooks in `torch.distributed.algorithms.ddp_comm_hooks`:

- `none`     DDP's own fp32 all-reduce (exact).
- `bf16`     gradients cast to bfloat16 for the all-reduce, then back: half the bytes, about
             3 significant digits kept, the fp32 range kept (no overflow, no loss scaling needed).
- `fp16`     the same in float16: more digits (about 4) but a narrow range; with fp32 gradients of
             ordinary size it is safe, tiny gradients can underflow to zero.
- `powersgd` PowerSGD low-rank compression (Vogels et al., 2019) with error feedback: each matrix
             gradient is sent as two thin factors of rank `powersgd_rank`. Far fewer bytes, but the
             step is an approximation whose error is carried to the next step, and it costs extra
             arithmetic (a QR per matrix) on every step.

All keep DDP's bucketing and its overlap of reduction with backward, except `powersgd` on gloo,
which finishes each bucket before the next (see `one_bucket_at_a_time`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from triax.errors import ConfigError
from triax.runtime.collectives_at_exit import keep_until_exit

COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")

# PowerSGD runs plain all-reduce for its first steps: DDP may rebuild its buckets after the first
# iteration, and error feedback needs stable bucket shapes. PyTorch requires at least 2.
POWERSGD_START_STEP = 10


def check_compression(name: str, powersgd_rank: int = 2) -> None:
    """Raise ConfigError for a value triax does not know; call before any process group exists."""
    if name not in COMPRESSIONS:
        raise ConfigError(f"parallel.grad_compression must be one of {', '.join(COMPRESSIONS)}, "
                          f"got {name!r}")
    if name == "powersgd" and (not isinstance(powersgd_rank, int) or powersgd_rank < 1):
        raise ConfigError(f"parallel.powersgd_rank must be a positive integer, got {powersgd_rank!r}")


def register_compression(ddp_model: nn.Module, name: str, powersgd_rank: int = 2,
                         process_group: dist.ProcessGroup | None = None,
                         powersgd_start_step: int = POWERSGD_START_STEP):
    """Register the hook for compression `name` on a DistributedDataParallel model.

    Returns the hook's state (the PowerSGDState for powersgd, else the process group or None),
    which callers can keep to inspect or checkpoint it.
    """
    check_compression(name, powersgd_rank)
    if name == "none":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name in ("bf16", "fp16"):
        if _backend(process_group) == "nccl":
            hook = default_hooks.bf16_compress_hook if name == "bf16" else default_hooks.fp16_compress_hook
        else:
            hook = cast_hook(torch.bfloat16 if name == "bf16" else torch.float16)
        ddp_model.register_comm_hook(process_group, hook)
        return process_group
    state = powerSGD_hook.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=powersgd_rank,
        start_powerSGD_iter=max(2, powersgd_start_step),
        # Small tensors (biases, LayerNorm) and matrices that rank-r factors would not shrink by
        # at least 2x are sent uncompressed: compressing them costs more than it saves.
        min_compression_rate=2,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    hook = powerSGD_hook.powerSGD_hook
    if _backend(process_group) != "nccl":
        hook = one_bucket_at_a_time(hook)
    ddp_model.register_comm_hook(state, hook)
    return state


def one_bucket_at_a_time(hook: Callable):
    """`hook`, finished before DDP hands it the next bucket.

    PowerSGD issues its second and third all-reduce (the P and Q factors) from future callbacks.
    Gloo runs those callbacks on its own worker thread when the previous collective completes,
    while DDP's backward keeps issuing the next bucket's collectives from the autograd thread.
    With two buckets in flight the ranks can then issue collectives in different orders, and gloo
    pairs mismatched ones: on a slow link the job aborts ("Received data size doesn't match
    expected size"). Waiting for each bucket keeps every rank's order the same, at the price of
    the overlap of that bucket's reduction with the rest of backward. (NCCL completes futures when
    the work is enqueued, so its order is already fixed.)"""

    def serialized(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future

    return serialized


def _backend(process_group: dist.ProcessGroup | None) -> str:
    return str(dist.get_backend(process_group)).lower()


def cast_hook(dtype: torch.dtype):
    """A DDP comm hook that all-reduces each gradient bucket in `dtype` and writes the mean back
    in the bucket's own dtype: the arithmetic of PyTorch's fp16/bf16_compress_hook, for backends
    other than NCCL (DDP refuses PyTorch's bf16 hook there; its check predates bf16 all-reduce in
    gloo), and with the write-back finished before the interpreter exits (`all_reduce_then`)."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        gradients = bucket.buffer()
        # Divide before summing so the sum of N ranks stays in range.
        wire = gradients.to(dtype).div_(group.size())

        def write_back(future: torch.futures.Future):
            gradients.copy_(future.value()[0])
            return gradients

        return all_reduce_then(wire, group, write_back)

    hook.__name__ = hook.__qualname__ = f"{str(dtype).removeprefix('torch.')}_cast_hook"
    return hook


def all_reduce_then(tensor: torch.Tensor, group: dist.ProcessGroup | None,
                    callback: Callable[[], None]) -> torch.futures.Future:
    """`dist.all_reduce(tensor, async_op=True).get_future().then(callback)`, with the work kept
    until the process ends: on gloo the callback runs, and is released, on gloo's worker thread,
    which must not happen while the interpreter finalizes (see kept_works.keep_until_exit)."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    keep_until_exit([work])
    return work.get_future().then(callback)
