"""triax.horovod in one process: API errors, optimizer bookkeeping, launcher command mapping.

These run inside the pytest process (world of one, no process group), so they are cheap; the
multi-process behaviour is covered by the other test_horovod_* files.
"""

import os
import re

import pytest
import torch

import triax.horovod as hvd
from triax.errors import TriaxError
from triax.commands import horovodrun
from triax.testing import run_torchrun

from support.horovod_support import horovod  # noqa: F401  (fixture: one process joined as a Horovod job)


def model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_topology_and_capabilities(horovod):
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    assert os.environ["HOROVOD_RANK"] == "0" and os.environ["HOROVOD_SIZE"] == "1"
    assert hvd.mpi_enabled() is False and hvd.mpi_built() is False
    assert hvd.gloo_built() is True and hvd.gloo_enabled() is True
    assert hvd.nccl_built() == torch.distributed.is_nccl_available()


def test_init_after_shutdown(horovod):
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(TriaxError, match="hvd.init"):
        hvd.size()
    hvd.init()
    assert hvd.is_initialized() and hvd.size() == 1


def test_unnamed_and_duplicate_parameters_are_errors(horovod):
    model, optimizer = model_and_optimizer()
    with pytest.raises(TriaxError, match="missing from named_parameters"):
        hvd.DistributedOptimizer(optimizer, named_parameters=list(model.named_parameters())[:2])
    named = list(model.named_parameters())
    duplicated = [("same", p) for _, p in named]
    with pytest.raises(TriaxError, match="duplicate names"):
        hvd.DistributedOptimizer(optimizer, named_parameters=duplicated)
    with pytest.raises(TriaxError, match="pairs"):
        hvd.DistributedOptimizer(optimizer, named_parameters=[p for _, p in named])


def test_zero_grad_with_pending_allreduce_is_an_error(horovod):
    model, optimizer = model_and_optimizer()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()  # hooks launch the (one-rank) allreduce
    with pytest.raises(TriaxError, match="zero_grad"):
        optimizer.zero_grad()
    optimizer.step()
    optimizer.zero_grad()  # fine once step() has synchronized


def test_too_many_backward_passes_is_an_error(horovod):
    model, optimizer = model_and_optimizer()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2)
    for _ in range(2):
        model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(TriaxError, match="backward_passes_per_step=2"):
        model(torch.ones(2, 3)).sum().backward()


def test_wrapped_optimizer_keeps_identity_and_state(horovod):
    model, optimizer = model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    assert wrapped is optimizer and isinstance(wrapped, torch.optim.SGD)
    with pytest.raises(TriaxError, match="already"):
        hvd.DistributedOptimizer(wrapped)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 3)).sum().backward()
    wrapped.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with wrapped.skip_synchronize():
        wrapped.step()
    scheduler.step()  # made before wrapping: must still drive the wrapped optimizer
    assert wrapped.param_groups[0]["lr"] == pytest.approx(0.05)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_unsupported_options_say_what_to_do(horovod):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ValueError, match="Min"):
        hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Min)
    with pytest.raises(TriaxError, match="process_set"):
        hvd.allreduce(torch.ones(2), process_set=object())
    with pytest.raises(TriaxError, match="splits"):
        hvd.alltoall(torch.ones(3), splits=[1, 1])


def test_compression_round_trip():
    tensor = torch.tensor([1.0, 2.5, -3.25], dtype=torch.float32)
    for compressor, wire in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
        sent, ctx = compressor.compress(tensor)
        assert sent.dtype == wire
        assert torch.equal(compressor.decompress(sent, ctx), tensor)
    integers = torch.arange(3)
    assert hvd.Compression.fp16.compress(integers)[0].dtype == torch.int64  # left alone


def test_horovodrun_maps_hosts_onto_torchrun(capsys):
    assert horovodrun.main(["-np", "3", "--dry-run", "python", "train.py"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "--nproc-per-node=3" in line and "--nnodes=1" in line and line.endswith(
        "-m triax.launch.horovod_worker --hostname=localhost --cross=0:1,0:1,0:1 -- python train.py")
    assert horovodrun.main(["-np", "6", "-H", "node1:4,node2:4", "--master-port", "1234", "--dry-run",
                            "python", "train.py"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("[node1] ssh") and "--nproc-per-node=4" in lines[0]
    assert "--node-rank=1" in lines[1] and "--nproc-per-node=2" in lines[1]
    assert all("--master-addr=node1" in line and "--master-port=1234" in line for line in lines)
    with pytest.raises(TriaxError, match="slots"):
        horovodrun.main(["-np", "9", "-H", "node1:4,node2:4", "python", "train.py"])


@pytest.mark.multiprocess
def test_the_job_is_left_at_exit_without_hvd_shutdown():
    # As Horovod's init registers shutdown: a gloo group still alive while the interpreter
    # finalizes can abort the process after a successful run (see docs/horovod.md).
    from support.forked import launch
    from support.horovod_support import WORKERS, child_env

    result = launch(2, [str(WORKERS / "exit_without_shutdown.py")], timeout=180, env=child_env())
    assert result.stdout.count("process group alive at exit: False") == 2, result.stdout[-2000:]


@pytest.mark.multiprocess
def test_no_gloo_thread_or_connection_outlives_shutdown_a_rejoin_or_the_end():
    # Before, hvd.shutdown() left gloo's connection thread and sockets open (a kept collective held
    # them; in a fresh process, torch.distributed.nn.functional's default arguments held the first
    # group too), so after an elastic reset the survivors' peers never saw this rank leave and
    # waited for the gloo timeout. Fresh processes (torchrun), not tests/support/forked.py's: a forked rank
    # inherits modules imported before any group existed, which hid the second cause.
    from support.horovod_support import WORKERS, child_env

    result = run_torchrun(2, [str(WORKERS / "shutdown_frees_group.py")], timeout=300, env=child_env())
    looks = {}
    for line in result.stdout.splitlines():  # torchrun's own lines have no counts
        look = re.fullmatch(r"(.+) threads=(\d+) gloo_sockets=(\d+)", line)
        if look:
            looks.setdefault(look.group(1), []).append((int(look.group(2)), int(look.group(3))))
    assert looks["baseline"] == [(1, 0), (1, 0)], result.stdout
    for when in ("joined 0", "joined 1", "joined at the end"):  # the check can fail: gloo was there
        assert all(threads > 1 and sockets > 0 for threads, sockets in looks[when]), (when, result.stdout)
    for when in ("left 0", "left 1", "exit"):
        assert looks[when] == [(1, 0), (1, 0)], (when, result.stdout)
