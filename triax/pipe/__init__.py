"""FairScale-style single-process pipeline parallelism: `Pipe(nn.Sequential, balance, chunks=...)`.

`from triax.pipe import Pipe` replaces `from fairscale.nn import Pipe`; the balancing helpers
replace `fairscale.nn.pipe.balance`, `triax.pipe.skip` replaces `fairscale.nn.pipe.skip` (skip
connections across partitions).
"""

from triax.pipe.balance import balance_by_size, balance_by_time, balance_cost
from triax.pipe.batchnorm import DeferredBatchNorm
from triax.pipe.checkpoint import is_checkpointing, is_recomputing
from triax.pipe.not_provided import AsyncPipe, LazyModule, PipeRPCWrapper
from triax.pipe.pipe import Pipe

__all__ = ["Pipe", "DeferredBatchNorm", "is_checkpointing", "is_recomputing", "balance_by_time", "balance_by_size",
           "balance_cost", "LazyModule", "AsyncPipe", "PipeRPCWrapper"]
