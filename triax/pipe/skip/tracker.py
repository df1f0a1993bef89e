"""Where stashed tensors wait until they are popped: one skip tracker per thread at a time.

Outside a `Pipe`, a `SkipTracker` is a dictionary: the popping layer gets the very tensor that was
stashed, still on autograd's graph. Inside a `Pipe`, each micro-batch has its own
`SkipTrackerThroughPortals`, installed (`use_skip_tracker`) while any partition runs that
micro-batch, in its forward pass and in its recomputation. A tensor popped in the partition that
stashed it stays in the dictionary; one that crosses partitions goes through a portal (portal.py),
copied to the pop partition's device just before that partition runs (`copy`).

How many reads a portal keeps its tensor for:

    not checkpointed: 2   PortalBlue at the stash, PortalOrange at the pop
    checkpointed:     3   the same two in the forward pass that keeps no activations, and the pop
                          partition's recomputation; the stash partition's recomputation (later:
                          backward runs in reverse) puts its recomputed tensor back for 1 read,
                          its own PortalBlue, which connects the gradient to the recomputed graph.

So the tensor is dropped at its last read, and nothing holds it during the rest of backward.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Protocol

import torch

from triax.pipe.recompute import is_checkpointing
from triax.pipe.dependency import fork, join
from triax.pipe.errors import PipeTypeError
from triax.pipe.skip.portal import Portal

if TYPE_CHECKING:
    from triax.pipe.microbatch import Batch
    from triax.pipe.skip.namespace import Namespace

# Reads of a portal's tensor, as counted in the module docstring.
READS_PLAIN = 2
READS_CHECKPOINTED = 3
READS_RECOMPUTED_STASH = 1


class SkipTracker:
    """Stashed tensors by (namespace, name), handed over as they are (no Pipe around)."""

    def __init__(self):
        self.tensors: dict = {}

    def save(self, batch: Batch, namespace: Namespace, name: str, tensor: torch.Tensor | None):
        """Keep `tensor` for the layer that pops it; returns the stashing layer's output `batch`."""
        self.tensors[(namespace, name)] = tensor
        return batch

    def load(self, batch: Batch, namespace: Namespace, name: str):
        """(the popping layer's input `batch`, the stashed tensor). KeyError if nothing was stashed."""
        return batch, self.tensors.pop((namespace, name))

    def copy(self, batch: Batch, namespace: Namespace, name: str, device: torch.device):
        raise PipeTypeError("copy is not supported for non-portal skip tensors: only a Pipe moves stashed "
                            "tensors between partitions")


def _lane_position(batch: Batch) -> int:
    """Which tensor of a batch carries the phonies: the first floating-point one.

    A phony joined into an integer tensor would be dropped by autograd (integers carry no
    gradient), and with it the stashed tensor's gradient.
    """
    tensors = (batch,) if isinstance(batch, torch.Tensor) else batch
    if not isinstance(tensors, tuple) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise PipeTypeError(f"a skippable layer whose tensor crosses partitions must take and return a tensor or "
                            f"a tuple of tensors, got {type(batch).__name__}; return the tensors as a tuple")
    for position, tensor in enumerate(tensors):
        if tensor.is_floating_point():
            return position
    return 0


def _lane(batch: Batch) -> torch.Tensor:
    return batch if isinstance(batch, torch.Tensor) else batch[_lane_position(batch)]


def _with_lane(batch: Batch, lane: torch.Tensor):
    if isinstance(batch, torch.Tensor):
        return lane
    position = _lane_position(batch)
    return batch[:position] + (lane,) + batch[position + 1:]


class CrossingSkips(Protocol):
    """What a tracker asks of the pipe's skip layout (layout.py's SkipLayout, which finds the skippable
    layers and so imports what imports this module): whether a skip crosses partitions."""

    def requires_copy(self, ns: Namespace, name: str) -> bool: ...


class SkipTrackerThroughPortals(SkipTracker):
    """One micro-batch's stashed tensors inside a Pipe; those that cross partitions go through portals.

    `layout` is the pipe's `SkipLayout`: which names cross partitions.
    """

    def __init__(self, layout: CrossingSkips):
        super().__init__()
        self.layout = layout
        self.portals: dict = {}

    def save(self, batch: Batch, namespace: Namespace, name: str, tensor: torch.Tensor | None):
        if not self.layout.requires_copy(namespace, name):
            return super().save(batch, namespace, name, tensor)
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            # A portal moves a tensor to the pop partition's device and its gradient back.
            raise PipeTypeError(f"stash('{name}', ...) was given a {type(tensor).__name__!r} value, not a tensor: a skip that "
                                "crosses partitions must be a tensor (or None); stash a tensor, e.g. "
                                "torch.tensor(value), or keep the stash and the pop in one partition")
        portal = self.portals.get((namespace, name))
        if portal is None:
            reads = READS_CHECKPOINTED if is_checkpointing() else READS_PLAIN
            portal = self.portals[(namespace, name)] = Portal(tensor, reads)
        else:  # the stash partition's recomputation: the portal was made in the forward pass
            portal.put_tensor(tensor, READS_RECOMPUTED_STASH)
        return _with_lane(batch, join(_lane(batch), portal.blue()))

    def load(self, batch: Batch, namespace: Namespace, name: str):
        if not self.layout.requires_copy(namespace, name):
            return super().load(batch, namespace, name)
        portal = self.portals[(namespace, name)]
        lane, branch = fork(_lane(batch))
        return _with_lane(batch, lane), portal.orange(branch)

    def copy(self, batch: Batch, namespace: Namespace, name: str, device: torch.device):
        """Move the stashed tensor to `device`, where `batch` is about to enter the pop partition."""
        lane, branch = fork(_lane(batch))
        branch = self.portals[(namespace, name)].copy(device, branch)
        return _with_lane(batch, join(lane, branch))


class _ThreadState(threading.local):
    skip_tracker: SkipTracker | None = None


_thread_state = _ThreadState()


@contextlib.contextmanager
def use_skip_tracker(skip_tracker: SkipTracker):
    """Make `skip_tracker` this thread's tracker within the context."""
    previous = _thread_state.skip_tracker
    _thread_state.skip_tracker = skip_tracker
    try:
        yield
    finally:
        _thread_state.skip_tracker = previous


def current_skip_tracker() -> SkipTracker:
    """This thread's tracker: the micro-batch's inside a Pipe, else a plain one made on first use."""
    if _thread_state.skip_tracker is None:
        _thread_state.skip_tracker = SkipTracker()
    return _thread_state.skip_tracker
