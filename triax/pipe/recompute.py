"""Running one partition on one micro-batch, with or without activation recomputation.

(Activation checkpointing, not snapshots, which are triax/checkpoint/. FairScale's module of the
same work is `fairscale.nn.pipe.checkpoint`: triax/pipe/__init__.py makes this module answer to
`triax.pipe.checkpoint` as well, its drop-in.)

Checkpointing keeps only a partition's input for each micro-batch and runs the partition again
during backward to rebuild what the gradients need, trading compute for memory. As in FairScale,
two autograd nodes carry it, so the graph shows it: `Checkpoint` (forward under no_grad, backward
through the rebuilt graph) and `Recompute` after it (its backward re-runs the partition, just
before the gradient reaches `Checkpoint`). Around them, the pipe's own business:

* Layers must know when they are being recomputed, so a `DeferredBatchNorm` does not count the
  same micro-batch twice. `is_recomputing()` answers that, per thread: recomputation runs in
  the backward thread while forward work runs in the partition workers. `is_checkpointing()`
  likewise answers during the forward pass that keeps no activations (a skip connection's portal
  then keeps its tensor for the recomputation, see skip/tracker.py).
* A plain BatchNorm would update its running statistics a second time while being recomputed;
  its statistics are put back afterwards, so checkpointing never changes them.
* Random numbers. The generator state is saved when the forward starts and restored when
  recomputing, so dropout draws the same mask twice. Partitions running at the
  same time in several threads share the CPU generator (and a CUDA device's generator when two
  partitions sit on one GPU): another thread could draw from it in between, and the recomputed
  mask would differ from the forward one, silently corrupting gradients. While a forward pass
  checkpoints anything, every partition therefore holds its device's generator lock while it runs
  (a custom layer may call F.dropout, which cannot be seen from outside); otherwise only partitions
  with known random layers do.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager, TYPE_CHECKING

import torch
from torch import nn

from triax.pipe.dependency import phony
from triax.pipe.microbatch import Batch, check_batch, rebuild, tensors_of

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

CHECKPOINT_MODES = ("always", "except_last", "never")

_thread_state = threading.local()

# Modules that draw from the default generator in training mode.
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)

_generator_locks: dict[str, threading.Lock] = {}
_generator_locks_guard = threading.Lock()


def is_checkpointing() -> bool:
    """True while the current thread runs a checkpointed forward pass (activations not kept)."""
    return getattr(_thread_state, "checkpointing", False)


def is_recomputing() -> bool:
    """True while the current thread re-runs a checkpointed forward pass during backward.

    A layer with side effects checks it so they happen once: `if not is_recomputing(): count += 1`.
    """
    return getattr(_thread_state, "recomputing", False)


@contextlib.contextmanager
def _thread_flag(name: str):
    previous = getattr(_thread_state, name, False)
    setattr(_thread_state, name, True)
    try:
        yield
    finally:
        setattr(_thread_state, name, previous)


def enable_checkpointing():
    """Make `is_checkpointing()` true in this thread within the context (FairScale's name)."""
    return _thread_flag("checkpointing")


def enable_recomputing():
    """Make `is_recomputing()` true in this thread within the context (FairScale's name)."""
    return _thread_flag("recomputing")


def checkpoint_stop(mode: str, num_micro_batches: int, training: bool) -> int:
    """Micro-batches with an index below this are checkpointed.

    'except_last' spares the last micro-batch: its backward starts right after its forward, so
    recomputing it would only cost time. Nothing is recomputed when no gradients are wanted.
    """
    if not training or not torch.is_grad_enabled():
        return 0
    return {"always": num_micro_batches, "except_last": num_micro_batches - 1, "never": 0}[mode]


def draws_random_numbers(partition: nn.Module) -> bool:
    """Whether the partition, as it stands, uses the random generator in its forward pass."""
    return any(isinstance(layer, _RANDOM_MODULES) and layer.training for layer in partition.modules())


def generator_lock(device: torch.device) -> threading.Lock:
    """The lock guarding the default random generator that `device` draws from."""
    key = "cpu" if device.type == "cpu" else str(device)
    with _generator_locks_guard:
        return _generator_locks.setdefault(key, threading.Lock())


@contextlib.contextmanager
def _batch_norm_statistics_kept(partition: nn.Module):
    """Let a recomputation update throw-away copies of plain BatchNorm running statistics.

    The copies are swapped in and the originals put back by reference, not copied over: the
    recomputed graph may hold the copies for its backward, and writing into them in place would
    trip autograd's version check.
    """
    swapped = []
    for layer in partition.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.training and layer.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                original = layer._buffers.get(name)
                if original is not None:
                    layer._buffers[name] = original.clone()
                    swapped.append((layer, name, original))
    try:
        yield
    finally:
        for layer, name, original in swapped:
            layer._buffers[name] = original


class _Recorded:
    """What one checkpointed (partition, micro-batch) keeps between forward and backward."""

    def __init__(self, partition: nn.Module, like: Batch, device: torch.device,
                 caller_state: Callable[[], ContextManager], label: str):
        self.partition, self.like, self.device, self.caller_state = partition, like, device, caller_state
        self.label = label  # names the partition in errors about its output
        self.inputs: tuple = ()
        self.cpu_rng: torch.Tensor | None = None
        self.cuda_rng: torch.Tensor | None = None
        self.recomputed: tuple | None = None  # (outputs, leaf inputs) once Recompute has run
        self.single_output = True  # the partition returned one tensor, not a tuple

    def save_rng(self) -> None:
        self.cpu_rng = torch.get_rng_state()
        if self.device.type == "cuda":
            self.cuda_rng = torch.cuda.get_rng_state(self.device)

    def recompute(self) -> None:
        """Run the partition again, with the forward's random state, recording a graph this time."""
        leaves = tuple(x.detach().requires_grad_(x.requires_grad) for x in self.inputs)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
            with torch.enable_grad(), self.caller_state(), on_device, enable_recomputing(), \
                    _batch_norm_statistics_kept(self.partition):
                outputs = self.partition(rebuild(leaves, self.like))
        self.recomputed = (tensors_of(outputs), leaves)


class Checkpoint(torch.autograd.Function):
    """Forward without keeping activations; backward through the graph `Recompute` rebuilt.

    Named like FairScale's, so `CheckpointBackward` nodes show which micro-batches are checkpointed.
    `phony` is an empty tensor that requires grad: the output then always joins the graph (and the
    partition's parameters get gradients) even when no input requires grad.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, phony: torch.Tensor, recorded: _Recorded, *inputs: torch.Tensor):
        ctx.recorded = recorded
        recorded.inputs = inputs
        recorded.save_rng()
        with torch.no_grad(), enable_checkpointing():
            outputs = recorded.partition(rebuild(inputs, recorded.like))
        check_batch(outputs, recorded.label)  # the rule at partition boundaries, checked before autograd sees it
        recorded.single_output = isinstance(outputs, torch.Tensor)
        return tensors_of(outputs)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor):
        recorded = ctx.recorded
        if recorded.recomputed is None:  # Recompute sits after us in the graph; normally it ran
            recorded.recompute()
        outputs, leaves = recorded.recomputed
        recorded.recomputed = None
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if out.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return (None, None, *[leaf.grad if leaf.requires_grad else None for leaf in leaves])


class Recompute(torch.autograd.Function):
    """Identity on the checkpointed outputs; its backward re-runs the partition, just before
    `Checkpoint`'s backward needs the rebuilt graph (FairScale's `RecomputeBackward`)."""

    @staticmethod
    def forward(ctx: FunctionCtx, recorded: _Recorded, *outputs: torch.Tensor):
        ctx.recorded = recorded
        detached = tuple(out.detach() for out in outputs)
        return detached[0] if recorded.single_output else detached

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor):
        ctx.recorded.recompute()
        return (None, *grads)


def run_partition(partition: nn.Module, batch: Batch, checkpoint: bool, device: torch.device | None = None,
                  caller_state: Callable[[], ContextManager] | None = None, label: str = "partition output") -> Batch:
    """Forward `batch` through `partition`, keeping activations or only the input (checkpoint).

    `caller_state` makes the context the forward pass runs under (autograd and autocast modes, the
    micro-batch's skip tracker): the recomputation runs under it again, in the backward thread.
    """
    if not checkpoint:
        return partition(batch)
    device = device if device is not None else torch.device("cpu")
    recorded = _Recorded(partition, batch, device, caller_state or contextlib.nullcontext, label)
    outputs = Checkpoint.apply(phony(device, requires_grad=True), recorded, *tensors_of(batch))
    return Recompute.apply(recorded, *outputs)
