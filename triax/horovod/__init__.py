"""Horovod's PyTorch API on torch.distributed: `import triax.horovod as hvd`.

Scripts written for `import horovod.torch as hvd` run unchanged but for the import, started by
torchrun, `triax launch`, `triax horovodrun` or `mpirun` (which only starts the processes: the
collectives are torch.distributed's, gloo on CPU and NCCL on GPU).
"""

from triax.horovod.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    disagreement_check_enabled, gloo_built, gloo_enabled, is_homogeneous,
    is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
    nccl_built, rank, rocm_built, set_disagreement_check, size, start_timeline, stop_timeline,
)
from triax.horovod.lifecycle import init, shutdown
from triax.horovod.broadcast_helpers import broadcast_optimizer_state, broadcast_parameters
from triax.horovod.collectives import (
    allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall,
    alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
    grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
    grouped_allreduce_async_, grouped_reducescatter, grouped_reducescatter_async, poll, reducescatter, reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from triax.horovod.compression import Compression, Compressor
from triax.horovod.errors import HorovodInternalError, HostsUpdatedInterrupt
from triax.horovod.joining import join
from triax.horovod.objects import allgather_object, broadcast_object
from triax.horovod.process_sets import ProcessSet, global_process_set
from triax.horovod.set_registration import add_process_set, remove_process_set
from triax.horovod.optimizer import DistributedOptimizer
from triax.horovod.run_function import run
from triax.horovod.reduce_ops import Adasum, Average, Max, Min, Product, Sum
from triax.horovod.sync_batchnorm import SyncBatchNorm
from triax.horovod import elastic

__all__ = [name for name in dir() if not name.startswith("_")]
