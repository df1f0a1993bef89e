"""`hvd.run`: Horovod's programmatic launcher, with Horovod's signature; the function and the
results travel as signed pickles."""

import inspect
import os
import pickle

import pytest

import triax.horovod as hvd
from horovod_support import child_env
from triax.horovod import run_function

# horovod.runner.run's parameters, in order (Horovod 0.28)
HOROVOD_PARAMETERS = [
    "func", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "slots", "reset_limit",
    "cooldown_range", "hosts", "hostfile", "host_discovery_script", "start_timeout", "ssh_port",
    "ssh_identity_file", "disable_cache", "output_filename", "verbose", "use_gloo", "use_mpi", "mpi_args",
    "network_interface", "network_interfaces", "executable", "np", "min_np", "max_np"]


def test_signature_is_horovods():
    assert list(inspect.signature(hvd.run).parameters) == HOROVOD_PARAMETERS


def test_arguments_horovod_refuses_are_refused():
    with pytest.raises(ValueError, match="hosts and hostfile"):
        hvd.run(print, hosts="a:1", hostfile="h")
    with pytest.raises(ValueError, match="use_gloo and use_mpi"):
        hvd.run(print, use_gloo=True, use_mpi=True)


class Planted:
    def __reduce__(self):
        return (os.system, ("touch planted-by-pickle",))


def test_a_value_without_the_jobs_signature_is_never_unpickled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    key, other = b"k" * 32, b"o" * 32
    assert run_function.loads(run_function.dumps({"x": 1}, key), key) == {"x": 1}
    forged = run_function.dumps(Planted(), other)
    with pytest.raises(RuntimeError, match="not signed with the job's key"):
        run_function.loads(forged, key)
    with pytest.raises(RuntimeError, match="not signed"):
        run_function.loads(b"\0" * 32 + pickle.dumps(Planted()), key)
    assert not (tmp_path / "planted-by-pickle").exists()


@pytest.mark.multiprocess
def test_results_come_back_in_rank_order(monkeypatch):
    for name, value in child_env().items():  # the workers import this checkout
        monkeypatch.setenv(name, value)
    scale = 10

    def job(offset, *, power=1):  # a closure: sent by value (cloudpickle)
        import torch

        import triax.horovod as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        return hvd.rank(), hvd.size(), (scale * total + offset) ** power

    assert hvd.run(job, args=(1,), kwargs={"power": 2}, num_proc=2) == [(0, 2, 961.0), (1, 2, 961.0)]
    # elastic (two host names for this machine): the first min_num_proc results, as Horovod's
    assert hvd.run(job, args=(0,), num_proc=2, min_num_proc=1, hosts="localhost:1,127.0.0.1:1") == [(0, 2, 30.0)]
