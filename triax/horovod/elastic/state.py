"""Elastic state objects: commit (remember), restore (go back to the last commit), sync (rank 0 wins).

Horovod's classes. `commit()` keeps a copy in host memory, then checks for host changes: under
`triax horovodrun`'s elastic driver, rank 0 reads the driver's notices and every rank raises
`HostsUpdatedInterrupt` at the same commit. Under torchrun (whose agent restarts the processes
instead, see __init__.py) a commit is also written to disk by rank 0, and `load_committed()`
reads it back in the restarted processes.

`TorchState` keeps models, optimizers and `ElasticSampler`s through handlers chosen by type
(Horovod's handler registry: `get_handler_registry()` / `set_handler_registry()`); every other
keyword is a plain value.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch

from triax.horovod import basics
from triax.horovod.broadcast_helpers import broadcast_optimizer_state, broadcast_parameters
from triax.horovod.elastic import commits, protocol
from triax.horovod.elastic import worker as elastic_worker
from triax.horovod.elastic.sampler import ElasticSampler
from triax.horovod.errors import HostsUpdatedInterrupt
from triax.horovod.objects import broadcast_object
from triax.runtime.rendezvous import restart_count


class State:
    """Base class: subclasses define save(), restore() and sync() (and may define reset())."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]):
        """Called after a reset, e.g. to rescale the learning rate to the new hvd.size()."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Remember the current state, then check for host changes (see check_host_updates)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Under the elastic driver: raise HostsUpdatedInterrupt on every rank at once if hosts were
        added or removed since the last check (rank 0 reads the notices and shares them).
        `skip_sync` is True when hosts were only removed: every rank is at this commit already."""
        if not elastic_worker.under_driver() or not basics.is_initialized():
            return  # under torchrun its agent restarts the processes when membership changes
        flags = elastic_worker.host_updates() if basics.rank() == 0 else protocol.NO_UPDATE
        flags = broadcast_object(flags, 0, name="elastic host updates")
        if flags != protocol.NO_UPDATE:
            raise HostsUpdatedInterrupt(skip_sync=flags == protocol.REMOVED)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """Called on a reset, before sync: adapt to the new world (nothing by default)."""

    def load_committed(self) -> bool:
        """Load the state a previous incarnation of this job committed to disk; True if found."""
        return False


class ObjectState(State):
    """Plain values (epoch, batch, ...) kept as attributes. Under torchrun restarts they are also
    written to disk, so they must be numbers, strings, None, lists, tuples, dicts or tensors."""

    def __init__(self, **values: Any):
        super().__init__()
        self._saved_values = copy.deepcopy(values)
        self._set_values(values)

    def _set_values(self, values: dict) -> None:
        for name, value in copy.deepcopy(values).items():
            object.__setattr__(self, name, value)

    def _current_values(self) -> dict:
        return {name: getattr(self, name) for name in self._saved_values}

    def _snapshot(self) -> dict:
        """Everything a commit holds, for the disk (see commits.py)."""
        return {"values": self._saved_values}

    def _apply_snapshot(self, snapshot: dict) -> None:
        self._saved_values = snapshot["values"]
        self._set_values(self._saved_values)

    def save(self):
        self._saved_values = copy.deepcopy(self._current_values())
        directory = commits.commit_directory()
        if directory:
            snapshot = self._snapshot()
            # Every rank checks that its values can be committed, so a bad value fails everywhere
            # at once instead of on rank 0 alone while the others wait.
            commits.check_committable(snapshot)
            if basics.rank() == 0:
                commits.write(directory, snapshot)

    def restore(self):
        self._set_values(self._saved_values)

    def sync(self):
        if self._saved_values:
            self._saved_values = broadcast_object(self._saved_values, 0, name="elastic state")
            self._set_values(self._saved_values)

    def load_committed(self) -> bool:
        """On a restart of this job (never on a first start), load rank 0's last commit."""
        if restart_count() == 0:
            directory = commits.commit_directory() if basics.rank() == 0 else None
            if directory:
                commits.discard(directory)  # left by an earlier job under the same name
            return False
        if basics.rank() != 0:
            return False  # rank 0 reads; sync() then hands its state to every rank
        directory = commits.commit_directory()
        try:
            saved = commits.read(directory) if directory else None
        except commits.CommitCorrupt as error:
            warnings.warn(f"hvd.elastic: ignoring the last commit, it cannot be read ({error}); "
                          "training restarts from the state the script built", stacklevel=2)
            return False
        if saved is None:
            return False
        self._apply_snapshot(saved)
        return True


# ---- TorchState: handlers by type --------------------------------------------------------------
class StateHandler:
    """Keeps one object's committed state; `saved` is what goes to disk under torchrun restarts."""

    def __init__(self, value: Any):
        self.value = value
        self.saved = None
        self.save()

    def set_value(self, value: Any):
        self.value = value
        self.save()

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """After a reset, before sync."""


class ModelStateHandler(StateHandler):
    def save(self):
        # Host memory, as Horovod's commit: a GPU model's copy does not take GPU memory.
        self.saved = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.value.state_dict().items()}

    def restore(self):
        self.value.load_state_dict(self.saved)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    def save(self):
        self.saved = _to_host(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    def save(self):
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self.saved)

    def sync(self):
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0, name="elastic sampler"))

    def reset(self):
        # The new world's ranks: Horovod re-splits only in sync(), which a reset that only removed
        # hosts skips (skip_sync), so the survivors would keep the old split and miss samples.
        self.value.reset()


def _to_host(value: Any):
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(item) for item in value)
    return copy.deepcopy(value)


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    return _handler_registry


def set_handler_registry(registry: Any):
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any):
    for kind, handler_class in _handler_registry:
        if isinstance(value, kind):
            return handler_class(value)
    return None


class TorchState(ObjectState):
    """Models, optimizers and samplers plus plain values: `TorchState(model, optimizer, epoch=0)`.
    Any keyword holding a Module, Optimizer or ElasticSampler is kept through its handler."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **values: Any):
        values.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in values.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any):
        # `state.model = other_model` replaces what is kept, as in Horovod.
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _snapshot(self) -> dict:
        return {"values": self._saved_values, "handlers": {name: h.saved for name, h in self._handlers.items()}}

    def _apply_snapshot(self, snapshot: dict) -> None:
        super()._apply_snapshot(snapshot)
        for name, saved in snapshot.get("handlers", {}).items():
            if name in self._handlers:
                self._handlers[name].saved = saved
                self._handlers[name].restore()

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()
