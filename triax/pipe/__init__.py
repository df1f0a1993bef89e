"""FairScale-style single-process pipeline parallelism: `Pipe(nn.Sequential, balance, chunks=...)`.

`from triax.pipe import Pipe` replaces `from fairscale.nn import Pipe`; the balancing helpers
replace `fairscale.nn.pipe.balance`, `triax.pipe.skip` replaces `fairscale.nn.pipe.skip` (skip
connections across partitions).

FairScale keeps `is_checkpointing` and `is_recomputing` in `fairscale.nn.pipe.checkpoint`; triax's
module is `recompute.py` (activation recomputation: triax/checkpoint/ is snapshots), and answers to
FairScale's name as well, so `from triax.pipe.checkpoint import ...` keeps working.
"""

import sys

from triax.pipe import recompute
from triax.pipe.balance import balance_by_size, balance_by_time, balance_cost
from triax.pipe.batchnorm import DeferredBatchNorm
from triax.pipe.recompute import is_checkpointing, is_recomputing
from triax.pipe.not_provided import AsyncPipe, LazyModule, PipeRPCWrapper
from triax.pipe.pipe import Pipe

__all__ = ["Pipe", "DeferredBatchNorm", "is_checkpointing", "is_recomputing", "balance_by_time", "balance_by_size",
           "balance_cost", "LazyModule", "AsyncPipe", "PipeRPCWrapper"]

checkpoint = recompute  # FairScale's module name (see the docstring)
sys.modules[f"{__name__}.checkpoint"] = recompute
