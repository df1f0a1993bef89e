"""What a new user meets in the first hour, each behaviour held: a finished run started again,
a run used from another directory, a launcher's command checked before anything starts."""

import sys

import pytest

from triax.arguments import check_command
from triax.cli import main as triax_main

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


@pytest.mark.parametrize("command,expected", [
    (["train.py"], "'train.py' is a Python script, not a program: put python before it"),
    (["python", "trian.py"], "training script 'trian.py' does not exist"),
    (["python", "-u", "-W", "ignore", "nowhere/train.py"], "training script 'nowhere/train.py' does not exist"),
    (["python", "-m", "no_such_module_here"], "module 'no_such_module_here' cannot be found"),
    (["pyhton", "train.py"], "program 'pyhton' is not a program on PATH"),
    (["./train.py"], "'./train.py' is a Python script, not a program"),
    (["python"], "names no script for python to run"),
])
def test_horovodrun_checks_its_command_before_starting(command, expected, tmp_path, monkeypatch, capsys):
    """One line and exit 2, as `triax launch` gives, before any process starts (a start would
    print every worker's traceback, or 'No such file or directory' for a file that is there)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('trained')\n")
    assert triax_main(["horovodrun", "-np", "2", *command]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and expected in error, error


@pytest.mark.parametrize("command", [["python", "-u", "train.py", "--lr", "1"], ["python3", "-m", "json.tool"],
                                     ["python", "-c", "print(1)"], ["./run.sh"], ["bash", "run.sh"]])
def test_a_runnable_command_passes_the_check(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('trained')\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    check_command(command, "triax horovodrun -np 2 python train.py")  # no error
