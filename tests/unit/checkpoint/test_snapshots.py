"""Snapshots in one process: verification and fallback, pruning, no unpickling, fsspec locations,
storage faults, and the resume/overwrite rules. (Multi-process faults: test_fault_tolerance.py.)"""

import errno
import json
import os
import pickle
import time

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from support.helpers import tiny_overrides
from triax import checkpoint
from triax.checkpoint.shards import ShardWriter
from triax.commands.cli import main as triax_main
from triax.errors import ConfigError
from triax.config import compose_config
from triax.train.trainer import Trainer


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def take_step(model, optimizer):
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_three(root):
    """Snapshots at steps 1, 2, 3 of a tiny model; returns the weights at each step."""
    model, optimizer = tiny_model()
    weights = {}
    for step in (1, 2, 3):
        take_step(model, optimizer)
        checkpoint.save_snapshot(str(root), step, model, optimizer, {"note": step})
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def loads_step(root, expected_weights):
    model, optimizer = tiny_model(seed=1)
    messages = []
    path, state = checkpoint.load_latest_snapshot(str(root), model, optimizer, report=messages.append)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected_weights[state["step"]][name])
    return state["step"], messages


def test_save_load_round_trip_restores_rng_and_optimizer(tmp_path):
    model, optimizer = tiny_model()
    take_step(model, optimizer)
    checkpoint.save_snapshot(str(tmp_path), 1, model, optimizer, {"epoch": 0})
    after_save = torch.rand(5)  # what the generator gives next
    take_step(model, optimizer)
    restored, restored_optimizer = tiny_model(seed=7)
    state = checkpoint.load_snapshot(checkpoint.latest_snapshot(str(tmp_path)), restored, restored_optimizer)
    assert state["step"] == 1 and state["epoch"] == 0 and state["world_size"] == 1
    assert torch.equal(torch.rand(5), after_save)
    # The restored optimizer takes the same next step as the original did.
    torch.manual_seed(3)
    take_step(restored, restored_optimizer)
    first = restored.state_dict()
    checkpoint.load_snapshot(checkpoint.latest_snapshot(str(tmp_path)), model, optimizer)
    torch.manual_seed(3)
    take_step(model, optimizer)
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "bad_rng_json", "missing_file"])
def test_damaged_latest_snapshot_is_reported_and_the_previous_one_used(tmp_path, damage):
    weights = save_three(tmp_path)
    newest = os.path.join(tmp_path, checkpoint.snapshot_name(3))
    model_file = os.path.join(newest, "shards", "rank_00000.bin")
    data = open(model_file, "rb").read()
    if damage == "truncate":
        open(model_file, "wb").write(data[: len(data) - 7])
    elif damage == "flip":
        open(model_file, "wb").write(data[:100] + bytes([data[100] ^ 0x40]) + data[101:])
    elif damage == "no_manifest":  # a torn write on an object store: never completed
        os.remove(os.path.join(newest, checkpoint.MANIFEST))
    elif damage == "bad_rng_json":
        open(os.path.join(newest, "rng", "rank_00000.json"), "w").write("{not json")
    elif damage == "missing_file":
        os.remove(os.path.join(newest, "shards.json"))
    step, messages = loads_step(tmp_path, weights)
    assert step == 2
    if damage == "no_manifest":
        assert messages == []  # incomplete, not corrupt: silently not a candidate
    else:
        assert len(messages) == 1 and "trying the previous snapshot" in messages[0]
        assert {"truncate": "truncated", "flip": "sha256", "bad_rng_json": "truncated",
                "missing_file": "missing"}[damage] in messages[0]
        assert os.path.isdir(newest + ".corrupt") and not os.path.exists(newest)


def test_all_snapshots_bad_is_an_error_not_a_silent_fresh_start(tmp_path):
    save_three(tmp_path)
    for snapshot in checkpoint.list_snapshots(str(tmp_path)):
        open(os.path.join(snapshot, "state.json"), "a").write(" ")
    model, optimizer = tiny_model()
    with pytest.raises(checkpoint.SnapshotError, match="none of the 3 snapshot"):
        checkpoint.load_latest_snapshot(str(tmp_path), model, optimizer)


def test_keep_last_prunes_old_snapshots_and_leftovers(tmp_path):
    model, optimizer = tiny_model()
    os.makedirs(tmp_path / "step_00000001.tmp")  # a write that was killed
    for step in range(2, 7):
        checkpoint.save_snapshot(str(tmp_path), step, model, optimizer, {}, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000005", "step_00000006"]


def test_loading_never_unpickles(tmp_path, monkeypatch):
    model, optimizer = tiny_model()
    take_step(model, optimizer)
    checkpoint.save_snapshot(str(tmp_path), 1, model, optimizer, {"epoch": 0})

    def refuse(*args, **kwargs):
        raise AssertionError("a snapshot load tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    restored, restored_optimizer = tiny_model(seed=5)
    checkpoint.load_snapshot(checkpoint.latest_snapshot(str(tmp_path)), restored, restored_optimizer)
    assert torch.equal(restored[0].weight, model[0].weight)
    files = sorted(os.path.relpath(os.path.join(d, f), checkpoint.latest_snapshot(str(tmp_path)))
                   for d, _, names in os.walk(checkpoint.latest_snapshot(str(tmp_path))) for f in names)
    assert files == ["manifest.json", "rng/rank_00000.json", "shards.json", "shards/rank_00000.bin", "state.json"]


# ---- the trainer in this process ----------------------------------------------------------------

def run_trainer(overrides):
    trainer = Trainer(compose_config(overrides))
    trainer.fit()
    return trainer


def test_memory_snapshot_location_end_to_end(tmp_path, tiny_corpus):
    """Snapshots on fsspec's memory:// store: preempted at step 2, resumed, and bitwise equal to an
    uninterrupted run (dropout on)."""
    extra = {"model.dropout": 0.1, "trainer.max_steps": 4, "trainer.save_every": 3}
    url = f"memory://triax-test-{os.getpid()}/{tmp_path.name}/snapshots"
    overrides = tiny_overrides(tmp_path / "memory", tiny_corpus, **extra, **{"trainer.snapshot_dir": url})
    assert triax_main(["train", *overrides, "debug.preempt_at_step=2"]) == 0
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(url)] == [2]
    resumed = run_trainer(overrides)
    assert resumed.last_snapshot == checkpoint.latest_snapshot(url) and resumed.last_snapshot.startswith("memory://")
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(url)] == [2, 3, 4]
    whole = run_trainer(tiny_overrides(tmp_path / "local", tiny_corpus, **extra))
    memory_weights = checkpoint.read_model_tensors(resumed.last_snapshot)
    local_weights = checkpoint.read_model_tensors(whole.last_snapshot)
    assert all(torch.equal(memory_weights[k], local_weights[k]) for k in local_weights)


class FlakyFileSystem(MemoryFileSystem):
    """An in-memory store whose writes fail (as a full disk does) when `fail_when(path)` says so."""

    protocol = "flaky"
    store: dict = {}
    pseudo_dirs = [""]
    fail_when = staticmethod(lambda path: False)

    def pipe_file(self, path, value, *args, **kwargs):
        if FlakyFileSystem.fail_when(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().pipe_file(path, value, *args, **kwargs)

    def _open(self, path, mode="rb", *args, **kwargs):
        if "w" in mode and FlakyFileSystem.fail_when(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super()._open(path, mode, *args, **kwargs)


@pytest.fixture
def flaky(monkeypatch):
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    FlakyFileSystem.store.clear()
    yield FlakyFileSystem
    FlakyFileSystem.fail_when = staticmethod(lambda path: False)


def test_full_storage_is_reported_training_goes_on_and_retries(tmp_path, tiny_corpus, flaky, capsys):
    # The step-4 save dies after its weights are written; the step-6 save cannot start.
    flaky.fail_when = staticmethod(lambda path: "step_00000004/shards/" in path or "step_00000006" in path)
    url = "flaky://run/snapshots"
    trainer = run_trainer(tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "trainer.max_steps": 8, "trainer.save_every": 2, "trainer.snapshot_dir": url}))
    assert trainer.step == 8
    err = capsys.readouterr().err
    assert "No space left on device" in err and "training goes on and retries at the next save" in err
    assert "(1/3 failures in a row" in err and "(2/3 failures in a row" in err
    # The failed attempts left nothing that counts as a snapshot; the good ones load.
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(url)] == [2, 8]
    assert checkpoint.read_state(checkpoint.list_snapshots(url)[0])["step"] == 2
    assert not any("step_00000004" in key for key in FlakyFileSystem.store)


def test_storage_failing_every_time_stops_the_run_loudly(tmp_path, tiny_corpus, flaky, capsys):
    flaky.fail_when = staticmethod(lambda path: "step_00000002" not in path)
    url = "flaky://loud/snapshots"
    code = triax_main(["train", *tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "trainer.max_steps": 8, "trainer.save_every": 2, "trainer.snapshot_dir": url,
        "trainer.max_save_failures": 2})])
    err = capsys.readouterr().err
    assert code == 2
    assert "2 snapshot attempts in a row failed (trainer.max_save_failures=2)" in err
    assert f"last good snapshot: {checkpoint.latest_snapshot(url)}" in err
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(url)] == [2]
    checkpoint.read_model_tensors(checkpoint.latest_snapshot(url))  # verifies its checksums


def test_unwritable_local_location_fails_loudly(tmp_path, tiny_corpus, capsys):
    (tmp_path / "blocker").write_text("a file where a directory should be")
    code = triax_main(["train", *tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "trainer.save_every": 2, "trainer.snapshot_dir": str(tmp_path / "blocker" / "snapshots"),
        "trainer.max_save_failures": 2})])
    err = capsys.readouterr().err
    assert code == 2 and "NotADirectoryError" in err and "failures in a row" in err


def test_resume_false_refuses_an_existing_run_unless_overwrite(tmp_path, tiny_corpus, monkeypatch, capsys):
    overrides = tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.max_steps": 2})
    run_trainer(overrides)
    with pytest.raises(ConfigError, match="already holds a run.*trainer.overwrite=true"):
        Trainer(compose_config([*overrides, "trainer.resume=false"]))
    # A torchrun restart continues the job's own snapshots whatever resume says.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Trainer(compose_config([*overrides, "trainer.resume=false"])).step == 2
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert Trainer(compose_config(overrides)).step == 2  # the default resumes, and says so
    assert "resuming from" in capsys.readouterr().out
    fresh = Trainer(compose_config([*overrides, "trainer.resume=false", "trainer.overwrite=true"]))
    assert fresh.step == 0 and checkpoint.list_snapshots(str(tmp_path / "run" / "snapshots")) == []


def test_snapshot_state_holds_what_exact_resume_needs(tmp_path, tiny_corpus):
    trainer = run_trainer(tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.max_steps": 3}))
    state = checkpoint.read_state(trainer.last_snapshot)
    assert {"step", "epoch", "sample_index", "scheduler", "scaler", "config", "triax_version", "world_size",
            "optimizer_groups", "model"} <= state.keys()
    assert state["step"] == 3 and state["sample_index"] == 3 * 8
    rng = json.loads(open(os.path.join(trainer.last_snapshot, "rng", "rank_00000.json")).read())
    assert {"python", "numpy", "torch"} <= rng.keys()


def test_trainer_falls_back_from_a_corrupted_snapshot_and_replays_bitwise(tmp_path, tiny_corpus, capsys):
    overrides = tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.save_every": 2, "model.dropout": 0.1})
    first = run_trainer(overrides)
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(str(tmp_path / "run" / "snapshots"))] == [2, 4, 6]
    expected = checkpoint.read_model_tensors(first.last_snapshot)
    target = os.path.join(first.last_snapshot, "shards", "rank_00000.bin")
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the newest snapshot's weights
    open(target, "wb").write(bytes(data))
    second = run_trainer(overrides)
    captured = capsys.readouterr()
    assert "fails its sha256 checksum" in captured.err and "trying the previous snapshot" in captured.err
    assert "resuming from" in captured.out and "step 4/6" in captured.out
    # Steps 5 and 6 were trained again from step 4, bitwise as the first time (dropout included).
    replayed = checkpoint.read_model_tensors(second.last_snapshot)
    assert all(torch.equal(replayed[k], expected[k]) for k in expected)
    assert os.path.isdir(first.last_snapshot + ".corrupt")


def test_save_on_epoch_end_snapshots_each_epoch_boundary(tmp_path, tiny_corpus):
    trainer = run_trainer(tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "data.truncate": 0.02, "trainer.batch_size": 32, "trainer.max_steps": "null", "trainer.max_epochs": 2,
        "trainer.save_on_epoch_end": "true", "trainer.keep_last": 0}))
    per_epoch = trainer.steps_per_epoch
    snapshots = checkpoint.list_snapshots(str(tmp_path / "run" / "snapshots"))
    assert [checkpoint.snapshot_step(s) for s in snapshots] == [per_epoch, 2 * per_epoch]
    first = checkpoint.read_state(snapshots[0])
    assert (first["epoch"], first["sample_index"]) == (0, per_epoch * 32)


def test_async_snapshot_is_complete_only_when_durable(tmp_path, monkeypatch):
    original_write = ShardWriter.write_data

    def slow_write(self, plan, planner):  # the background write is still running when we look
        written = original_write(self, plan, planner)
        time.sleep(0.5)
        return written

    monkeypatch.setattr(ShardWriter, "write_data", slow_write)
    model, optimizer = tiny_model()
    take_step(model, optimizer)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    pending = checkpoint.start_snapshot(str(tmp_path), 1, model, optimizer, {"epoch": 0}, asynchronous=True)
    take_step(model, optimizer)  # the step loop goes on: the snapshot holds the staged copy
    assert checkpoint.list_snapshots(str(tmp_path)) == []  # still being written: no manifest, not a candidate
    path = pending.wait()
    assert checkpoint.list_snapshots(str(tmp_path)) == [path]
    saved = checkpoint.read_model_tensors(path)
    assert all(torch.equal(saved[k], v) for k, v in weights.items())


def test_async_save_trainer_run_equals_synchronous(tmp_path, tiny_corpus):
    extra = {"trainer.save_every": 2, "model.dropout": 0.1, "trainer.max_steps": 4}
    sync = run_trainer(tiny_overrides(tmp_path / "sync", tiny_corpus, **extra))
    background = run_trainer(tiny_overrides(tmp_path / "async", tiny_corpus, **extra, **{"trainer.async_save": "true"}))
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(background.snapshot_root)] == [2, 4]
    expected, got = checkpoint.read_model_tensors(sync.last_snapshot), checkpoint.read_model_tensors(background.last_snapshot)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_failure_no_retry_can_fix_stops_at_once_with_its_cause(tmp_path, tiny_corpus, monkeypatch, capsys):
    """Only a storage fault (an OSError) is retried at the next save; anything else (here a
    RuntimeError from inside the writer) would fail again: one attempt, the real cause, no advice
    about free space."""
    import triax.checkpoint.snapshot as snapshot

    attempts = []

    def broken_rng_state():
        attempts.append(1)
        raise RuntimeError("the RNG state cannot be read")

    monkeypatch.setattr(snapshot, "capture_rng_state", broken_rng_state)
    code = triax_main(["train", *tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "trainer.max_steps": 8, "trainer.save_every": 2})])
    err = capsys.readouterr().err
    assert code == 2 and len(attempts) == 1, err
    assert "RuntimeError: the RNG state cannot be read" in err and "not a storage fault" in err
    assert "Free space" not in err and "retries at the next save" not in err


@pytest.mark.multiprocess
def test_snapshots_need_no_attribute_of_the_triax_package(tmp_path, tiny_corpus):
    """With an editable install, a folder named `triax` in the working directory (the parent of a
    checkout) makes `triax` a namespace package: its submodules load, its __init__ never runs. A
    run there must still write its snapshots (it once failed at every save, importing
    triax.__version__ at save time)."""
    import subprocess
    import sys

    import triax
    from triax.testing import quiet_env

    package_dir = os.path.dirname(triax.__file__)
    script = ("import sys, types\n"
              "namespace = types.ModuleType('triax')\n"
              f"namespace.__path__ = [{package_dir!r}]\n"
              "sys.modules['triax'] = namespace\n"
              "from triax.commands.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", script, "train",
                             *tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})],
                            capture_output=True, text=True, env=quiet_env(), timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoint.snapshot_step(checkpoint.latest_snapshot(str(run_dir / "snapshots"))) == 2
