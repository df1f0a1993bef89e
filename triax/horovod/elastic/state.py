"""Elastic state objects: commit (remember), restore (go back to the last commit), sync (rank 0 wins)."""

from __future__ import annotations

import copy
import warnings

from triax.horovod import basics
from triax.horovod.broadcast_helpers import broadcast_optimizer_state, broadcast_parameters
from triax.horovod.elastic import commits
from triax.horovod.objects import broadcast_object
from triax.rendezvous import restart_count


class State:
    """Base class: subclasses define save(), restore() and sync()."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Called after a restart, e.g. to rescale the learning rate to the new hvd.size()."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        # torchrun's agent restarts the processes when membership changes; nothing to poll here.
        return None

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def load_committed(self) -> bool:
        """Load the state a previous incarnation of this job committed to disk; True if found."""
        return False


class ObjectState(State):
    """Plain values (epoch, batch, ...) kept as attributes: numbers, strings, None, lists, tuples,
    dicts and tensors, which is what a commit can hold without pickle."""

    def __init__(self, **values):
        super().__init__()
        self._names = list(values)
        for name, value in values.items():
            setattr(self, name, value)
        self._saved = self._snapshot()

    def _snapshot(self) -> dict:
        return {"values": copy.deepcopy({name: getattr(self, name) for name in self._names})}

    def _apply(self, snapshot: dict) -> None:
        for name, value in copy.deepcopy(snapshot["values"]).items():
            setattr(self, name, value)

    def save(self):
        self._saved = self._snapshot()
        directory = commits.commit_directory()
        if directory:
            # Every rank checks that its values can be committed, so a bad value fails everywhere
            # at once instead of on rank 0 alone while the others wait.
            commits.check_committable(self._saved["values"])
            if basics.rank() == 0:
                commits.write(directory, self._saved)

    def restore(self):
        self._apply(self._saved)

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
        self._saved = saved
        self.restore()
        return True

    def sync(self):
        values = broadcast_object({name: getattr(self, name) for name in self._names}, 0,
                                  name="elastic state")
        for name, value in values.items():
            setattr(self, name, value)


class TorchState(ObjectState):
    """A model and optimizer plus plain values: `TorchState(model=m, optimizer=o, epoch=0)`."""

    def __init__(self, model=None, optimizer=None, **values):
        self.model, self.optimizer = model, optimizer
        super().__init__(**values)

    def _snapshot(self) -> dict:
        snapshot = super()._snapshot()
        if self.model is not None:
            snapshot["model"] = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            snapshot["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        return snapshot

    def _apply(self, snapshot: dict) -> None:
        super()._apply(snapshot)
        if self.model is not None and "model" in snapshot:
            self.model.load_state_dict(snapshot["model"])
        if self.optimizer is not None and "optimizer" in snapshot:
            self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))

    def sync(self):
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()
