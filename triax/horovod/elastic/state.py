"""Elastic state objects: commit (remember), restore (go back to the last commit), sync (rank 0 wins)."""

from __future__ import annotations

import copy
import os
import tempfile

import torch

from triax.horovod import basics
from triax.horovod.broadcast_helpers import broadcast_optimizer_state, broadcast_parameters
from triax.horovod.objects import broadcast_object

DIRECTORY_ENV = "TRIAX_HOROVOD_ELASTIC_DIR"


def commit_directory() -> str | None:
    """Where commits are written so restarted processes find them; None: memory only.

    TRIAX_HOROVOD_ELASTIC_DIR wins (use a shared directory across machines). Under torchrun with
    restarts allowed, the default is a temp directory named after the run id and the torchrun
    agent's pid, which stay the same across restarts of one job and differ between jobs.
    """
    if os.environ.get(DIRECTORY_ENV):
        return os.environ[DIRECTORY_ENV]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return None
    return os.path.join(tempfile.gettempdir(), "triax-horovod-elastic", f"{run_id}-{os.getppid()}")


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
    """Plain picklable values (epoch, batch, ...) kept as attributes."""

    _file_name = "state.pt"

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
        directory = commit_directory()
        if directory and basics.rank() == 0:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, self._file_name)
            temporary = path + ".tmp"
            torch.save(self._saved, temporary)
            os.replace(temporary, path)  # a crash mid-write leaves the previous commit intact

    def restore(self):
        self._apply(self._saved)

    def load_committed(self) -> bool:
        directory = commit_directory()
        path = os.path.join(directory, self._file_name) if directory else None
        if not path or not os.path.exists(path):
            return False
        self._saved = torch.load(path, map_location="cpu", weights_only=False)
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
