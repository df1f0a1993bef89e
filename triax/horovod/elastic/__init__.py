"""`hvd.elastic`: training that survives a lost or added worker, on torchrun's elastic mode.

Horovod restarts the training function inside the same processes. Under torchrun the agent
restarts the processes themselves (on a failure, or when nodes join or leave with
`--nnodes=MIN:MAX`), so in-memory state does not survive. `state.commit()` therefore also writes
the committed state to disk (rank 0, atomically), and `hvd.elastic.run` reloads it in the new
processes, then syncs every rank from rank 0, as Horovod's restore/sync would.
"""

from triax.horovod.elastic.state import ObjectState, State, TorchState
from triax.horovod.elastic.runner import HorovodInternalError, HostsUpdatedInterrupt, run

__all__ = ["run", "State", "ObjectState", "TorchState", "HorovodInternalError", "HostsUpdatedInterrupt"]
