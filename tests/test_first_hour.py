"""What a new user meets in the first hour, each behaviour held: a finished run started again,
a run used from another directory, a launcher's command checked before anything starts."""

import pytest

from helpers import tiny_overrides, train


@pytest.mark.multiprocess
def test_a_finished_run_started_again_says_it_is_complete_and_what_to_do(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})
    train(overrides)
    again = train(overrides)
    assert "is already complete" in again.stdout, again.stdout
    assert "raise trainer.max_steps" in again.stdout and "another trainer.run_dir" in again.stdout
    assert "done:" not in again.stdout and "training " not in again.stdout  # no summary of 0 steps
    assert not (run_dir / ".triax.lock").exists()  # the run directory is free again
    further = train(overrides + ["trainer.max_steps=4"])
    assert "resuming from" in further.stdout and "done: 2 steps" in further.stdout, further.stdout
