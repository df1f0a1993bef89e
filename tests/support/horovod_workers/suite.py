"""A Horovod user's test suite, run by every rank (started by tests/unit/horovod/test_horovod_suite.py).

Each test does its collectives first and its assertions after, so a failed assertion on one rank
cannot leave another waiting inside a collective. After each test every rank shares its outcome
(one allgather), so all ranks agree on PASS/FAIL and start the next test together. Rank 0 prints
one 'PASS name' or 'FAIL name ranks [...]' line per test; a failing rank prints why.
"""

import faulthandler
import os
import warnings

import torch

import triax.horovod as hvd

faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", "240")), exit=True)
hvd.init()
rank, size = hvd.rank(), hvd.size()

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]
TESTS = []


def test(function):
    TESTS.append(function)
    return function


def value(r, shape=(2, 3), dtype=torch.int64):
    """What rank r contributes: small whole numbers, exact in every dtype (bool: parity)."""
    count = 1
    for dim in shape:
        count *= dim
    base = torch.arange(count, dtype=torch.int64).reshape(shape) + 3 * r
    return (base % 2 == 0) if dtype == torch.bool else base.to(dtype)


def same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got, want), (got, want)


@test
def every_dtype_in_every_collective():
    results = {}
    for dtype in DTYPES:
        mine = value(rank, dtype=dtype)
        if dtype != torch.bool:  # Horovod reduces numbers, not booleans
            results[dtype, "sum"] = hvd.allreduce(mine, op=hvd.Sum)
            inplace = mine.clone()
            hvd.allreduce_(inplace, op=hvd.Sum)
            results[dtype, "sum_"] = inplace
            results[dtype, "async"] = hvd.synchronize(hvd.allreduce_async(mine, op=hvd.Max))
            rows = torch.cat([value(rank, dtype=dtype)] * size)  # (2 size, 3)
            results[dtype, "reducescatter"] = hvd.reducescatter(rows, op=hvd.Sum)
        results[dtype, "allgather"] = hvd.allgather(value(rank, (rank + 1, 2), dtype))
        results[dtype, "grouped_allgather"] = hvd.grouped_allgather([value(rank, (rank + 1, 2), dtype)])[0]
        results[dtype, "broadcast"] = hvd.broadcast(mine, root_rank=size - 1)
        target = mine.clone()
        hvd.broadcast_(target, root_rank=0)
        results[dtype, "broadcast_"] = target
        outgoing = torch.cat([value(rank, (s + 1, 2), dtype) for s in range(size)])
        results[dtype, "alltoall"] = hvd.alltoall(outgoing, splits=[s + 1 for s in range(size)])[0]
    for (dtype, what), got in results.items():
        if what in ("sum", "sum_"):
            want = sum(value(r).to(torch.int64) for r in range(size)).to(dtype)
        elif what == "async":
            want = value(size - 1, dtype=dtype)
        elif what == "reducescatter":
            want = sum(torch.cat([value(r)] * size) for r in range(size))[2 * rank:2 * rank + 2].to(dtype)
        elif what in ("allgather", "grouped_allgather"):
            want = torch.cat([value(r, (r + 1, 2), dtype) for r in range(size)])
        elif what == "broadcast":
            want = value(size - 1, dtype=dtype)
        elif what == "broadcast_":
            want = value(0, dtype=dtype)
        else:  # alltoall: rank s sent us rank + 1 rows of its value
            want = torch.cat([value(s, (rank + 1, 2), dtype) for s in range(size)])
        same(got, want)


@test
def integers_wrap_and_average_as_horovod():
    big16 = hvd.allreduce(torch.tensor([32767, -32768], dtype=torch.int16), op=hvd.Sum)
    big8 = hvd.allreduce(torch.tensor([200], dtype=torch.uint8), op=hvd.Sum)
    grouped = hvd.grouped_allreduce([torch.tensor([rank], dtype=torch.int16), torch.tensor([1.5 * rank])],
                                    op=hvd.Sum)
    averaged = hvd.allreduce(torch.tensor([-3 + rank, 3 + rank], dtype=torch.int32), op=hvd.Average)
    same(big16, (torch.tensor([32767, -32768]) * size).to(torch.int16))  # wraps like int16 does
    same(big8, torch.tensor([200 * size]).to(torch.uint8))
    same(grouped[0], torch.tensor([sum(range(size))], dtype=torch.int16))
    same(grouped[1], torch.tensor([1.5 * sum(range(size))]))
    total = torch.tensor([sum(-3 + r for r in range(size)), sum(3 + r for r in range(size))])
    # Horovod scales and casts back to the integer type: rounded toward zero (-3.5 -> -3, not -4)
    same(averaged, torch.div(total, size, rounding_mode="trunc").to(torch.int32))


@test
def gradients_as_horovod_defines_them():
    grads = {}
    for op in (hvd.Sum, hvd.Average):
        x = torch.ones(size * 4, 3, requires_grad=True)
        hvd.reducescatter(x, op=op).backward(torch.ones(4, 3))
        grads["reducescatter", op] = x.grad
        xs = [torch.ones(size * 4, 3, requires_grad=True) for _ in range(2)]
        for out in hvd.grouped_reducescatter(xs, op=op):
            out.backward(torch.ones(4, 3))
        grads["grouped_reducescatter", op] = xs[1].grad
    sizes = [3, 2, 7, 4][:size] + [1] * max(0, size - 4)
    x = torch.full((sizes[rank], 5), float(rank), requires_grad=True)
    hvd.allgather(x).backward(torch.cat([torch.full((n, 5), float(r)) for r, n in enumerate(sizes)]))
    grads["allgather"] = x.grad
    y = torch.full((3,), float(rank), requires_grad=True)
    hvd.broadcast(y, root_rank=0).backward(torch.ones(3))
    grads["broadcast"] = y.grad
    z = torch.ones(3, requires_grad=True)
    hvd.allreduce(z, op=hvd.Sum).backward(torch.ones(3))
    grads["allreduce"] = z.grad

    size_f = float(size)
    same(grads["reducescatter", hvd.Sum], torch.full((size * 4, 3), size_f))
    same(grads["reducescatter", hvd.Average], torch.ones(size * 4, 3))
    same(grads["grouped_reducescatter", hvd.Sum], torch.full((size * 4, 3), size_f))
    same(grads["grouped_reducescatter", hvd.Average], torch.ones(size * 4, 3))
    same(grads["allgather"], torch.full((sizes[rank], 5), float(rank)))
    same(grads["broadcast"], torch.ones(3) if rank == 0 else torch.zeros(3))
    same(grads["allreduce"], torch.full((3,), size_f))


def raised(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001  (the test inspects what was raised)
        return error
    return None


@test
def errors_are_horovods_and_the_same_on_every_rank():
    mismatch = raised(lambda: hvd.allreduce(torch.zeros(rank + 1), name="grad.w"))
    bad_root = raised(lambda: hvd.broadcast(torch.zeros(2), root_rank=size if rank == 1 else 0))
    scalar = raised(lambda: hvd.reducescatter(torch.tensor(1.0)))
    bad_splits = raised(lambda: hvd.alltoall(torch.zeros(3), splits=[3] + [0] * (size - 1) if rank else [1]))
    messages = hvd.allgather_object([str(mismatch), str(bad_root), str(scalar), str(bad_splits)])
    after = hvd.allreduce(torch.ones(2), op=hvd.Sum)  # the group still works
    not_a_tensor = raised(lambda: hvd.allreduce([1.0, 2.0]))
    for error in (mismatch, bad_root, scalar):
        assert isinstance(error, RuntimeError) and isinstance(error, hvd.HorovodInternalError), repr(error)
    assert isinstance(bad_splits, ValueError), repr(bad_splits)  # Horovod's class for bad splits, on every rank
    assert all(m == messages[0] for m in messages), messages  # word for word on every rank
    assert "rank 1" in str(bad_root) and f"root_rank={size}" in str(bad_root)
    assert isinstance(not_a_tensor, TypeError)
    same(after, torch.full((2,), float(size)))


@test
def process_sets_like_horovod():
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvd.add_process_set(hvd.ProcessSet([r for r in range(size) if r % 2 == 1]))
    mine, other = (evens, odds) if rank % 2 == 0 else (odds, evens)
    members = [r for r in range(size) if r % 2 == rank % 2]
    root = members[-1]
    summed = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=mine)
    gathered = hvd.allgather(torch.tensor([rank]), process_set=mine)
    broadcast = hvd.broadcast(torch.tensor([rank]), root_rank=root, process_set=mine)
    obj = hvd.broadcast_object({"from": rank}, root_rank=root, process_set=mine)
    hvd.barrier(process_set=mine)
    x = torch.ones(2, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum, process_set=mine).sum().backward()
    layer = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(layer.weight)
    hvd.broadcast_parameters(layer.state_dict(), root_rank=root, process_set=mine)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0),
                                         named_parameters=layer.named_parameters(), process_set=mine)
    layer(torch.full((1, 1), float(rank))).sum().backward()
    optimizer.step()
    outside = raised(lambda: hvd.allreduce(torch.ones(1), process_set=other))
    described = (mine.size(), mine.rank(), mine.included(), other.included())
    removed = [hvd.remove_process_set(odds), hvd.remove_process_set(odds), hvd.remove_process_set(evens)]
    after = raised(lambda: hvd.allreduce(torch.ones(1), process_set=mine))
    assert described == (len(members), members.index(rank), True, False), described
    same(summed, torch.tensor([float(sum(members))]))
    same(gathered, torch.tensor(members))
    same(broadcast, torch.tensor([root]))
    assert obj == {"from": root}
    same(x.grad, torch.full((2,), float(len(members))))
    same(layer.weight.detach(), torch.full((1, 1), -sum(members) / len(members)))
    assert isinstance(outside, ValueError) and "not in" in str(outside), outside
    assert removed == [True, False, True] and isinstance(after, ValueError), (removed, after)
    assert mine.size() is None  # no longer registered


@test
def sparse_allreduce_and_sparse_gradients():
    rows = torch.tensor([[rank, rank + 1]])
    sparse = torch.sparse_coo_tensor(rows, torch.tensor([1.0, 2.0]) * (rank + 1), (size + 1,))
    summed = hvd.sparse_allreduce_async(sparse, name="s", op=hvd.Sum)()  # a function, as Horovod's
    averaged = hvd.sparse_allreduce_async(sparse, name="a")()
    embedding = torch.nn.Embedding(size + 1, 2, sparse=True)
    torch.nn.init.zeros_(embedding.weight)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=1.0),
                                         named_parameters=embedding.named_parameters())
    embedding(torch.tensor([rank])).sum().backward()  # gradient 1 on row `rank`, this rank only
    optimizer.step()
    dense = sum(torch.sparse_coo_tensor(torch.tensor([[r, r + 1]]), torch.tensor([1.0, 2.0]) * (r + 1),
                                        (size + 1,)).to_dense() for r in range(size))
    assert summed.is_sparse and averaged.is_sparse
    same(summed.to_dense(), dense)
    torch.testing.assert_close(averaged.to_dense(), dense / size)  # divided before the sum: rounding
    expected = torch.zeros(size + 1, 2)
    expected[:size] = -1.0 / size  # each row got one rank's gradient, averaged over all ranks
    same(embedding.weight.detach(), expected)


def adasum_reference(vectors):
    """The published rule, written out: halves combined recursively, lower half first."""
    if len(vectors) == 1:
        return vectors[0]
    a, b = adasum_reference(vectors[:len(vectors) // 2]), adasum_reference(vectors[len(vectors) // 2:])
    dot = float((a * b).sum())
    return (1 - dot / (2 * float((a * a).sum()))) * a + (1 - dot / (2 * float((b * b).sum()))) * b


@test
def adasum_like_horovod():
    vectors = [torch.tensor([r + 1.0, 1.0, -float(r), 2.0], dtype=torch.float64) for r in range(size)]
    result = raised(lambda: hvd.allreduce(vectors[rank], op=hvd.Adasum))
    if size & (size - 1):
        assert isinstance(result, NotImplementedError) and "power-of-two" in str(result), repr(result)
        return
    result = hvd.allreduce(vectors[rank], op=hvd.Adasum)
    layer = torch.nn.Linear(4, 1, bias=False, dtype=torch.float64)
    torch.nn.init.zeros_(layer.weight)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0),
                                         named_parameters=layer.named_parameters(), op=hvd.Adasum)
    layer(vectors[rank][None]).sum().backward()  # this rank's gradient is its vector
    optimizer.step()
    parallel = hvd.allreduce(torch.full((3,), 2.0, dtype=torch.float64), op=hvd.Adasum)
    torch.testing.assert_close(result, adasum_reference(vectors), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight.detach()[0], -adasum_reference(vectors), rtol=1e-12, atol=1e-12)
    same(parallel, torch.full((3,), 2.0, dtype=torch.float64))  # equal gradients: their average


@test
def lifecycle_like_horovod():
    hvd.shutdown()
    before = raised(hvd.size)
    initialized = hvd.is_initialized()
    ends = hvd.ProcessSet([0, size - 1])
    hvd.init(process_sets=[ends])
    again = (hvd.rank(), hvd.size())
    in_ends = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ends) if rank in (0, size - 1) else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.start_timeline("/tmp/timeline.json")
        hvd.stop_timeline()
    summed = hvd.allreduce(torch.ones(1), op=hvd.Sum)
    assert isinstance(before, ValueError) and "hvd.init" in str(before) and not initialized
    assert again == (rank, size) and len(caught) == 2
    same(summed, torch.full((1,), float(size)))
    if in_ends is not None:
        same(in_ends, torch.full((1,), 2.0))


failed = 0
for function in TESTS:
    try:
        function()
        ok, detail = 1, ""
    except Exception as error:  # noqa: BLE001  (reported, then the suite goes on)
        ok, detail = 0, f"{type(error).__name__}: {str(error)[:500]}"
    outcomes = hvd.allgather(torch.tensor([ok]), name=f"outcome of {function.__name__}").tolist()
    if not ok:
        print(f"rank {rank} {function.__name__}: {detail}", flush=True)
    if rank == 0:
        bad = [r for r, good in enumerate(outcomes) if not good]
        print(f"FAIL {function.__name__} ranks {bad}" if bad else f"PASS {function.__name__}", flush=True)
    failed += not all(outcomes)
hvd.shutdown()
raise SystemExit(1 if failed else 0)
