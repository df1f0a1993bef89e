"""`hvd.run`: Horovod's programmatic launcher, with Horovod's signature; the function and the
results travel as signed pickles."""

import inspect
import os
import pickle

import pytest

import triax.horovod as hvd
from support.horovod_support import child_env
from triax.errors import TriaxError
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
    sign, read = run_function.dumps, run_function.loads
    assert read(sign({"x": 1}, key, "job", "result", 0), key, "job", "result", 0) == {"x": 1}
    forged = sign(Planted(), other, "job", "result", 0)
    with pytest.raises(RuntimeError, match="not signed with this job's key"):
        read(forged, key, "job", "result", 0)
    with pytest.raises(RuntimeError, match="not signed"):
        read(b"\0" * 32 + pickle.dumps(Planted()), key, "job", "result", 0)
    assert not (tmp_path / "planted-by-pickle").exists()


def test_a_signed_value_copied_to_another_rank_kind_or_job_is_refused(tmp_path, monkeypatch):
    """The signature binds (job, kind, rank, payload): rank 0's result filed as rank 1's, a
    result offered as the function, or another job's value, is refused before unpickling."""
    monkeypatch.chdir(tmp_path)
    key = b"k" * 32
    rank_0 = run_function.dumps(Planted(), key, "job-a", "result", 0)
    for job, kind, rank in [("job-a", "result", 1), ("job-a", "function", -1), ("job-b", "result", 0)]:
        with pytest.raises(RuntimeError, match="copied from another rank or job") as caught:
            run_function.loads(rank_0, key, job, kind, rank)
        assert isinstance(caught.value, TriaxError) and "\n" not in str(caught.value)
    assert not (tmp_path / "planted-by-pickle").exists()


def listening_addresses(port):
    """The addresses a TCP socket listens on at `port` (/proc/net/tcp's hex form; 0100007F is 127.0.0.1)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return sorted(found)


def test_the_store_of_a_job_on_this_machine_listens_on_loopback_only():
    store = run_function.job_store(local_only=True)
    assert listening_addresses(store.port) == ["0100007F"]
    everywhere = run_function.job_store(local_only=False)
    assert listening_addresses(everywhere.port) not in ([], ["0100007F"])


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
