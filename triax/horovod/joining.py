"""`hvd.join()`: a rank that ran out of data keeps serving the others' collectives until all join.

It relies on the check round (check.py): each collective starts with a metadata allgather. A
joined rank submits a JOIN row in that round, reads what the active ranks are about to do, and
takes part with neutral data: zeros for sums, ones for products, the dtype's extreme for min/max,
as Horovod does, allgather, broadcast, alltoall and reducescatter are refused while a rank has
joined (the active ranks raise HorovodInternalError). Averages divide by the size of the set,
joined ranks included, as Horovod's do (a joined rank contributes zeros).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from triax.horovod.errors import HorovodInternalError, HorovodValueError
from triax.horovod import basics, check, engine, handles, process_sets, reduce_ops
from triax.horovod.process_sets import ProcessSet, global_process_set, in_process_set

# Layout digest -> DistributedOptimizer, so a joined rank can serve a gradient step (optimizer.py).
optimizers_by_layout: dict = {}


@in_process_set
def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Block until every rank (of the set) has called join(); return the rank that joined last."""
    world = basics.world()
    if process_sets.active_size() == 1:
        return world.rank
    if not world.check:
        raise HorovodValueError(f"hvd.join() needs the per-collective check round, which is off "
                         f"({basics.CHECK_ENV}=0 or hvd.init(check=False)); turn it back on to use join")
    handles.start_submitted()  # this rank's own asynchronous operations go before it joins
    joined_at = check.rounds()
    while True:
        rows = check.gather_rows(check.make_row("join", root=world.rank, extra=joined_at))
        agreement = check.check_rows(rows, "join")
        if agreement.active_count == 0:
            break
        if agreement.refused is None:  # a refused collective moves no data: the active ranks raise
            _serve(agreement)
    # The rank that joined last submitted its first JOIN row in the latest round.
    stamps = rows[:, 6 + check.MAX_DIMS].tolist()
    latest = max(stamps)
    return process_sets.active_ranks()[max(r for r, stamp in enumerate(stamps) if stamp == latest)]


def _serve(agreement: check.Agreement) -> None:
    """Take part, with neutral data, in the collective the active ranks announced."""
    active = [r for r in range(agreement.rows.shape[0]) if r not in agreement.joined]
    row = agreement.rows[active[0]]
    kind = check.KINDS[int(row[0])]
    op, root = int(row[2]), int(row[3])
    if kind == "allreduce" and op == reduce_ops.Adasum:
        raise HorovodInternalError("allreduce: op=hvd.Adasum cannot run while ranks have joined")
    if kind == "allreduce":
        buffer = reduce_ops.neutral_fill(torch.empty(check.replay_shape(row), dtype=check.replay_dtype(row), device=check.replay_device(row)), op)
        handles.wait_one(dist.all_reduce(engine.to_wire(buffer), op=reduce_ops.torch_op(op), group=process_sets.active_group(),
                               async_op=True))
    elif kind == "barrier":
        handles.wait_one(dist.barrier(group=process_sets.active_group(), async_op=True))
    elif kind == "broadcast_object":
        with handles.failures_as_internal_error():
            dist.broadcast_object_list([None], src=root, group=process_sets.active_group())
    elif kind == "allgather_object":
        with handles.failures_as_internal_error():
            dist.all_gather_object([None] * process_sets.active_size(), None, group=process_sets.active_group())
    elif kind == "optimizer layout":
        pass  # a DistributedOptimizer was built; nothing to exchange
    elif kind == "optimizer step":
        layout = int(row[6 + check.MAX_DIMS])
        optimizer = optimizers_by_layout.get(layout)
        optimizer = optimizer() if optimizer is not None else None
        if optimizer is None:
            raise HorovodInternalError("hvd.join(): the other ranks are stepping a DistributedOptimizer this "
                             "rank does not have; create the same optimizer on every rank")
        optimizer._serve_joined_step()
    else:
        raise HorovodInternalError(f"hvd.join(): cannot take part in {kind!r} while joined")
