"""Started by tests/unit/horovod/test_horovod_collectives.py under torchrun (2 or 3 processes).

Checks every collective against its definition, computed locally from what each rank is known to
contribute. Packed into one script so the suite pays process start-up once per world size.
Prints 'collectives ok' on success; any failed check raises and the process exits non-zero.
"""

import faulthandler
import os

import torch
from torch.testing import assert_close

import triax.horovod as hvd
from triax.errors import TriaxError

# A hang becomes a traceback and a failure instead of a stuck test.
faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", "240")), exit=True)
hvd.init()
rank, size = hvd.rank(), hvd.size()
check_on = hvd.disagreement_check_enabled()


def contribution(r, shape=(2, 3), dtype=torch.float32):
    """What rank r brings: distinct per rank and per element."""
    count = 1
    for dim in shape:
        count *= dim
    return (torch.arange(count, dtype=torch.float64).reshape(shape) + 10 * r + 1).to(dtype)


everyone = [contribution(r) for r in range(size)]
mine = contribution(rank)

# ---- allreduce: every op, scaling, compression, in-place, async --------------------------------
stack = torch.stack(everyone)
expected = {hvd.Sum: stack.sum(0), hvd.Average: stack.mean(0), hvd.Min: stack.min(0).values,
            hvd.Max: stack.max(0).values, hvd.Product: stack.prod(0)}
for op, want in expected.items():
    assert_close(hvd.allreduce(mine, op=op, name=f"op{op}"), want)
assert_close(hvd.allreduce(mine, average=False), stack.sum(0))
assert_close(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), 1.5 * stack.sum(0))
assert_close(hvd.allreduce(mine, compression=hvd.Compression.fp16), stack.mean(0), rtol=1e-3, atol=1e-2)
assert_close(hvd.allreduce(mine, compression=hvd.Compression.bf16, op=hvd.Sum), stack.sum(0), rtol=1e-2, atol=0.5)
integers = torch.tensor([rank + 1, 7 * rank], dtype=torch.int64)
assert_close(hvd.allreduce(integers, op=hvd.Sum),
             torch.tensor([sum(r + 1 for r in range(size)), sum(7 * r for r in range(size))]))
inplace = mine.clone()
returned = hvd.allreduce_(inplace, op=hvd.Max)
assert returned is inplace
assert_close(inplace, expected[hvd.Max])
strided = mine.clone().t()  # non-contiguous: must still be reduced in place
hvd.allreduce_(strided, op=hvd.Sum)
assert_close(strided, stack.sum(0).t())
handle = hvd.allreduce_async(mine, op=hvd.Sum, name="async")
hvd.poll(handle)  # may be True or False; must not raise
assert_close(hvd.synchronize(handle), stack.sum(0))
target = mine.clone()
handle = hvd.allreduce_async_(target, op=hvd.Min)
assert hvd.synchronize(handle) is target
assert_close(target, expected[hvd.Min])
try:
    hvd.synchronize(handle)
    raise AssertionError("synchronizing a handle twice must fail")
except TriaxError:
    pass

# gradient of allreduce: y = sum_s x_s on every rank, loss = sum_r <y, w_r> -> dx = sum_r w_r
x = mine.clone().requires_grad_()
weights = [torch.full((2, 3), float(r + 1)) for r in range(size)]
(hvd.allreduce(x, op=hvd.Sum) * weights[rank]).sum().backward()
assert_close(x.grad, sum(weights))
x = mine.clone().requires_grad_()
(hvd.allreduce(x) * weights[rank]).sum().backward()  # Average: the gradient is averaged too
assert_close(x.grad, sum(weights) / size)

# ---- grouped allreduce: mixed dtypes, one fused allreduce per dtype -----------------------------
group = [mine, contribution(rank, (4,), torch.float64), torch.tensor([rank], dtype=torch.int32)]
reduced = hvd.grouped_allreduce(group, op=hvd.Sum)
assert_close(reduced[0], stack.sum(0))
assert_close(reduced[1], sum(contribution(r, (4,), torch.float64) for r in range(size)))
assert_close(reduced[2], torch.tensor([sum(range(size))], dtype=torch.int32))
copies = [t.clone() for t in group]
hvd.grouped_allreduce_(copies, op=hvd.Sum)
assert_close(copies[1], reduced[1])
assert_close(hvd.synchronize(hvd.grouped_allreduce_async(group))[0], stack.mean(0))
a, b = mine.clone().requires_grad_(), contribution(rank, (4,)).requires_grad_()
out_a, out_b = hvd.grouped_allreduce([a, b], op=hvd.Sum)
(out_a.sum() + 2 * out_b.sum()).backward()
assert_close(a.grad, torch.full((2, 3), float(size)))
assert_close(b.grad, torch.full((4,), 2.0 * size))

# ---- allgather with a different first dimension per rank --------------------------------------
def rows_of(r):
    return torch.full((r + 1, 2), float(r)) + torch.arange(2.0)

gathered = hvd.allgather(rows_of(rank))
assert_close(gathered, torch.cat([rows_of(r) for r in range(size)]))
assert_close(hvd.synchronize(hvd.allgather_async(rows_of(rank))), gathered)
assert_close(hvd.allgather(torch.tensor([rank])), torch.arange(size))
x = rows_of(rank).requires_grad_()
coefficients = torch.arange(float(gathered.numel())).reshape(gathered.shape)
(hvd.allgather(x) * coefficients).sum().backward()
offset = sum(r + 1 for r in range(rank))
assert_close(x.grad, coefficients[offset:offset + rank + 1])  # averaged over ranks: all equal
grouped = hvd.grouped_allgather([rows_of(rank), torch.tensor([rank])])
assert_close(grouped[1], torch.arange(size))
handle = hvd.grouped_allgather_async([rows_of(rank), torch.tensor([rank])], name="grouped.gather")
pending_max = hvd.allreduce_async(mine, op=hvd.Max)  # a second operation in flight beside it
grouped_async = hvd.synchronize(handle)
assert isinstance(grouped_async, list) and len(grouped_async) == 2
assert_close(grouped_async[0], gathered)
assert_close(grouped_async[1], torch.arange(size))
assert_close(hvd.synchronize(pending_max), stack.max(0).values)

# ---- broadcast --------------------------------------------------------------------------------
root = size - 1
assert_close(hvd.broadcast(mine, root_rank=root), everyone[root])
assert_close(mine, contribution(rank))  # out-of-place leaves the input alone
target = mine.clone()
hvd.broadcast_(target, root_rank=0)
assert_close(target, everyone[0])
assert_close(hvd.synchronize(hvd.broadcast_async(mine, 1)), everyone[1])
x = mine.clone().requires_grad_()
(hvd.broadcast(x, root_rank=root) * weights[rank]).sum().backward()
assert_close(x.grad, sum(weights) / size if rank == root else torch.zeros(2, 3))

# ---- alltoall ---------------------------------------------------------------------------------
# rank r sends (r + s + 1) rows of value 100 r + s to rank s
splits = [rank + s + 1 for s in range(size)]
outgoing = torch.cat([torch.full((rank + s + 1, 2), 100.0 * rank + s) for s in range(size)])
received, received_splits = hvd.alltoall(outgoing, splits=splits)
assert_close(received, torch.cat([torch.full((s + rank + 1, 2), 100.0 * s + rank) for s in range(size)]))
assert received_splits.tolist() == [s + rank + 1 for s in range(size)]
even = torch.arange(size * 2.0) + 10 * rank  # two rows for each rank
assert_close(hvd.alltoall(even), torch.cat([torch.tensor([10.0 * s + 2 * rank, 10.0 * s + 2 * rank + 1])
                                            for s in range(size)]))
assert_close(hvd.synchronize(hvd.alltoall_async(outgoing, splits=splits))[0], received)
x = outgoing.clone().requires_grad_()
out, _ = hvd.alltoall(x, splits=splits)
(out * (rank + 1)).sum().backward()  # rows sent to rank s come back with rank s's factor
assert_close(x.grad, torch.cat([torch.full((rank + s + 1, 2), float(s + 1)) for s in range(size)]))

# ---- reducescatter: Horovod's uneven split (earlier ranks take the extra rows) ------------------
rows = 2 * size + 1
scattered_inputs = [torch.arange(rows * 2.0).reshape(rows, 2) * (r + 1) for r in range(size)]
shares = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
start = sum(shares[:rank])
total = sum(scattered_inputs)
assert_close(hvd.reducescatter(scattered_inputs[rank], op=hvd.Sum), total[start:start + shares[rank]])
assert_close(hvd.reducescatter(scattered_inputs[rank]), (total / size)[start:start + shares[rank]])
assert_close(hvd.synchronize(hvd.reducescatter_async(scattered_inputs[rank], op=hvd.Max)),
             scattered_inputs[-1][start:start + shares[rank]])
# grouped and asynchronous: Horovod's positional order (tensors, name, op)
second = [torch.full((size + 2, 3), float(r + 1)) for r in range(size)]
second_shares = [(size + 2) // size + (1 if r < (size + 2) % size else 0) for r in range(size)]
handle = hvd.grouped_reducescatter_async([scattered_inputs[rank], second[rank]], "grouped.scatter", hvd.Sum)
first_out, second_out = hvd.synchronize(handle)
assert_close(first_out, total[start:start + shares[rank]])
assert_close(second_out, torch.full((second_shares[rank], 3), float(sum(range(1, size + 1)))))
assert_close(hvd.synchronize(hvd.reducescatter_async(scattered_inputs[rank], "positional", hvd.Sum)),
             total[start:start + shares[rank]])
x = scattered_inputs[rank].clone().requires_grad_()
hvd.reducescatter(x, op=hvd.Sum).sum().mul(rank + 1).backward()
# Horovod's gradient: the gathered upstream gradients, times size for op=Sum
assert_close(x.grad, torch.cat([torch.full((shares[r], 2), float((r + 1) * size)) for r in range(size)]))

# ---- objects and barrier ----------------------------------------------------------------------
assert hvd.broadcast_object({"from": rank, "list": [rank] * 3}, root_rank=root) == {"from": root, "list": [root] * 3}
assert hvd.allgather_object(("rank", rank)) == [("rank", r) for r in range(size)]
hvd.barrier()

# ---- SyncBatchNorm equals BatchNorm over the global batch --------------------------------------
torch.manual_seed(0)
full_batch = torch.randn(4 * size, 3, 5)
weight, bias = torch.randn(3), torch.randn(3)
reference = torch.nn.BatchNorm1d(3)
synced = hvd.SyncBatchNorm(3)
with torch.no_grad():
    for module in (reference, synced):
        module.weight.copy_(weight)
        module.bias.copy_(bias)
full = full_batch.clone().requires_grad_()
upstream = torch.randn(4 * size, 3, 5)
reference_out = reference(full)
(reference_out * upstream).sum().backward()
local = full_batch[4 * rank:4 * rank + 4].clone().requires_grad_()
out = synced(local)
(out * upstream[4 * rank:4 * rank + 4]).sum().backward()
assert_close(out, reference_out[4 * rank:4 * rank + 4].detach(), rtol=1e-4, atol=1e-5)
assert_close(local.grad, full.grad[4 * rank:4 * rank + 4], rtol=1e-4, atol=1e-5)
assert_close(synced.running_mean, reference.running_mean)
assert_close(synced.running_var, reference.running_var)
assert_close(hvd.allreduce(synced.weight.grad, op=hvd.Sum), reference.weight.grad, rtol=1e-4, atol=1e-5)

# ---- disagreement: an error on every rank, not a hang ------------------------------------------
def expect_disagreement(call, *words):
    try:
        call()
    except TriaxError as error:
        message = str(error)
        assert "disagree" in message and all(w in message for w in words), message
        return
    raise AssertionError("ranks disagreed but no error was raised")


if check_on:
    expect_disagreement(lambda: hvd.allreduce(torch.zeros(rank + 1, 3), name="grad.w"),
                        "'grad.w'", "shape=(1, 3)", "shape=(2, 3)", "TRIAX_HOROVOD_CHECK=0")
    expect_disagreement(lambda: hvd.allreduce(torch.zeros(3, dtype=torch.float32 if rank else torch.float64)),
                        "float64", "float32")
    expect_disagreement(lambda: hvd.broadcast(torch.zeros(3), root_rank=0 if rank else 1), "root_rank")
    expect_disagreement(lambda: hvd.allreduce(torch.zeros(3), op=hvd.Sum if rank else hvd.Max), "op=Max")
    expect_disagreement(lambda: hvd.allgather(torch.zeros(2, 2 + (rank > 0))), "allgather")
    expect_disagreement(lambda: hvd.allreduce(torch.zeros(3)) if rank else hvd.broadcast(torch.zeros(3), 0),
                        "allreduce", "broadcast")
    model = torch.nn.Linear(3, 2 + (rank > 0))
    expect_disagreement(lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                         named_parameters=model.named_parameters()),
                        "optimizer layout")
    # the group still works after the errors
    assert_close(hvd.allreduce(mine, op=hvd.Sum), stack.sum(0))

    # ---- join: rank 0 runs out of data first; the others keep reducing (Horovod's rules: the
    # joined rank contributes zeros and averages divide by the whole size; allgather and broadcast
    # are refused on the active ranks while the joined rank keeps waiting) -----------------------
    layer = torch.nn.Linear(2, 1, bias=False)  # every rank builds the optimizer before joining
    with torch.no_grad():
        layer.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0),
                                   named_parameters=layer.named_parameters())
    if rank == 0:
        last = hvd.join()
    else:
        assert_close(hvd.allreduce(mine, op=hvd.Sum), sum(everyone[1:]))
        assert_close(hvd.allreduce(mine), sum(everyone[1:]) / size)
        assert_close(hvd.allreduce(mine, op=hvd.Min), torch.stack(everyone[1:]).min(0).values)
        handle = hvd.allreduce_async(mine, name="after join")  # started at synchronize, rank 0 serves it
        assert_close(hvd.synchronize(handle), sum(everyone[1:]) / size)
        for refused in (lambda: hvd.allgather(rows_of(rank)), lambda: hvd.broadcast(mine, root_rank=1)):
            try:
                refused()
                raise AssertionError("allgather/broadcast must be refused while a rank has joined")
            except hvd.HorovodInternalError as error:
                assert "not supported with Join" in str(error), error
        # a data-parallel step with the DistributedOptimizer while rank 0 is joined
        layer(torch.full((1, 2), float(rank))).sum().backward()
        opt.step()
        mean_input = sum(range(1, size)) / size  # rank 0's zero gradient counts in the average
        assert_close(layer.weight, torch.full((1, 2), 1.0 - mean_input))
        last = hvd.join()
    assert last in range(1, size), last
else:
    try:
        hvd.join()
        raise AssertionError("join must refuse to run without the check round")
    except TriaxError as error:
        assert "join" in str(error)

# ---- init after shutdown ----------------------------------------------------------------------
hvd.shutdown()
assert not hvd.is_initialized()
hvd.init()
assert (hvd.rank(), hvd.size()) == (rank, size)
assert_close(hvd.allreduce(mine, op=hvd.Sum), stack.sum(0))
hvd.shutdown()
print(f"rank {rank}: collectives ok", flush=True)
