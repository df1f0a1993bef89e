"""`hvd.elastic`: training that survives lost, added and removed workers.

Under `triax horovodrun --host-discovery-script/--min-np` (driver.py) this is Horovod's elastic
mode: the workers stay up, and on a reset they go back to the last commit (a worker was lost) or
keep their state (hosts changed), then rejoin with their new ranks and sync from rank 0.

Under torchrun (`--max-restarts`, `--nnodes=MIN:MAX`) the agent restarts the processes
themselves, so in-memory state does not survive: `state.commit()` therefore also writes the
committed state to disk (rank 0, atomically), and `hvd.elastic.run` reloads it in the new
processes, then syncs every rank from rank 0, as Horovod's restore/sync would.

The names below are loaded on first use: hvd.init() and DistributedOptimizer import this
package's worker module, which must not pull the state classes (built on them) in first.
"""

import importlib

_HOMES = {"run": "runner", "State": "state", "ObjectState": "state", "TorchState": "state",
          "ElasticSampler": "sampler", "HorovodInternalError": "runner", "HostsUpdatedInterrupt": "runner"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


def __dir__():
    return sorted(list(globals()) + __all__)
