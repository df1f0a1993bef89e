"""One job per run directory: a run directory in use is refused with its holder, the lock goes with
the job, and a lock taken on a file its holder removed is taken again."""

import os

import pytest

from support.helpers import tiny_overrides
from triax.commands.cli import main as triax_main


def test_a_run_directory_in_use_is_refused_with_its_holder(sandbox, tiny_corpus):
    import fcntl

    run_dir = sandbox.work / "run"
    run_dir.mkdir()
    with open(run_dir / ".triax.lock", "w") as holder:
        holder.write("host elsewhere pid 4242\n")
        holder.flush()
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: a rival job
        sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus)], "in use by another triax job",
                        "pid 4242")
    # The holder's exit releases it: the same command now trains.
    from triax.runs import lock as run_lock

    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})]) == 0
    run_lock.unlock_run_dir(str(run_dir))


def test_the_lock_file_goes_with_the_job(sandbox, tiny_corpus):
    run_dir = sandbox.work / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})]) == 0
    assert not (run_dir / ".triax.lock").exists()
    assert (run_dir / "snapshots").is_dir()


def test_a_lock_taken_on_a_file_its_holder_removed_is_taken_again(tmp_path, monkeypatch):
    """A job that ends removes its lock file; a rival that opened the old file just before gets
    the lock on a file no longer at the path: it must take the path's current file instead, or a
    third job could hold the run directory at the same time."""
    import fcntl

    from triax.runs import lock as run_lock

    real_flock = run_lock.fcntl.flock
    removed = []

    def flock_after_the_holder_left(descriptor, operation):
        real_flock(descriptor, operation)
        if not removed:  # the previous holder unlinked the file between our open and our lock
            removed.append(True)
            os.unlink(tmp_path / ".triax.lock")

    monkeypatch.setattr(run_lock.fcntl, "flock", flock_after_the_holder_left)
    run_lock.lock_run_dir(str(tmp_path))
    try:
        with open(tmp_path / ".triax.lock") as rival:
            with pytest.raises(BlockingIOError):
                fcntl.flock(rival.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # the file at the path is held
    finally:
        run_lock.unlock_run_dir(str(tmp_path), remove=True)
    assert removed and not (tmp_path / ".triax.lock").exists()
