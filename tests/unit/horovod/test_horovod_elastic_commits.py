"""hvd.elastic commits without pickle: what is written, where, and what is refused on reading."""

import json
import os
import pickle

import pytest
import torch

import triax.horovod as hvd
from triax.horovod.elastic import commits


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A torchrun job with restarts allowed, its private commit directory under tmp_path."""
    for name in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE", commits.DIRECTORY_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(commits.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    saved = dict(os.environ)
    hvd.init()
    yield tmp_path / f"triax-horovod-elastic-{os.getuid()}"
    hvd.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_commit_round_trip_keeps_types_and_tensors(job, monkeypatch):
    model, optimizer = model_and_optimizer()
    values = {"epoch": 3, "history": [("0", 1), ("1", 2)], "by_id": {7: None, "x": [1.5, True]}}
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, **values)
    state.commit()
    assert oct(os.stat(job).st_mode & 0o777) == "0o700"
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optimizer = optimizer.state_dict()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted attempt
    fresh_model = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh_model.parameters(), lr=0.5)
    fresh = hvd.elastic.TorchState(model=fresh_model, optimizer=fresh_optimizer, epoch=0, history=[], by_id={})
    assert fresh.load_committed()
    assert (fresh.epoch, fresh.history, fresh.by_id) == (3, [("0", 1), ("1", 2)], {7: None, "x": [1.5, True]})
    for key, value in expected_model.items():
        assert torch.equal(fresh_model.state_dict()[key], value)
    loaded = fresh_optimizer.state_dict()
    assert loaded["param_groups"][0]["betas"] == (0.8, 0.9) and loaded["param_groups"][0]["lr"] == 0.1
    for index, entry in expected_optimizer["state"].items():
        for name, tensor in entry.items():
            assert torch.equal(loaded["state"][index][name], tensor)


def test_first_start_reads_nothing_and_forgets_a_planted_commit(job, monkeypatch):
    state = hvd.elastic.ObjectState(epoch=5)
    state.commit()
    state.epoch = 0
    assert not state.load_committed()  # restart count 0: a first start
    assert state.epoch == 0 and not any(job.rglob(commits.FILE_NAME))


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/triax-elastic-pwned",))


def test_a_planted_pickle_is_never_loaded(job, monkeypatch):
    state = hvd.elastic.ObjectState(epoch=0)
    state.commit()
    directory = next(p for p in job.iterdir() if p.is_dir())
    for name in ("state.pt", commits.FILE_NAME):
        (directory / name).write_bytes(pickle.dumps({"values": {"epoch": Boom()}}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.warns(UserWarning, match="cannot be read"):
        assert not state.load_committed()
    assert state.epoch == 0 and not os.path.exists("/tmp/triax-elastic-pwned")


@pytest.mark.parametrize("document", ["[]", json.dumps({"tuple": 3}), "[" * 5000 + "]" * 5000,
                                      json.dumps({"dict": [[[1], 2]]}), json.dumps({"code": "os.system"})])
def test_a_damaged_commit_is_refused(tmp_path, document):
    from safetensors.torch import save_file

    save_file({}, str(tmp_path / commits.FILE_NAME), metadata={"triax_elastic_state": document})
    with pytest.raises(commits.CommitCorrupt):
        commits.read(str(tmp_path))


def test_a_directory_others_can_write_or_a_symlink_is_refused(job, tmp_path):
    job.mkdir(mode=0o777)
    os.chmod(job, 0o777)
    with pytest.raises(ValueError, match="writable by others"):
        hvd.elastic.ObjectState(epoch=0).commit()
    job.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    job.symlink_to(elsewhere)
    with pytest.raises(ValueError, match="not a directory"):
        hvd.elastic.ObjectState(epoch=0).commit()
    assert not any(elsewhere.iterdir())


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_a_directory_of_another_user_is_refused(job):
    job.mkdir(mode=0o700)
    os.chown(job, 4242, 4242)
    with pytest.raises(ValueError, match="belongs to uid 4242"):
        hvd.elastic.ObjectState(epoch=0).commit()


def test_values_that_need_pickle_are_refused_at_commit(job):
    with pytest.raises(TypeError, match="cannot be committed"):
        hvd.elastic.ObjectState(epoch=0, sampler=object()).commit()
