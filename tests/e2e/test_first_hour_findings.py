"""The smaller things a new user met in a first hour, each held: a closed pipe, abbreviated options,
another tool's key names, torch's advice to its developers, "1 steps", nanoGPT's unset best loss."""

import logging
import subprocess
import sys

import pytest
import torch

from triax.commands.cli import main as triax_main
from triax.testing import quiet_env
from triax.runtime.torch_logs import DTENSOR_LOGGERS, quiet_torch_logs
from triax.interop.nanogpt.run import nanogpt_best

from support.helpers import tiny_overrides, train


@pytest.mark.multiprocess
def test_a_closed_pipe_ends_the_run_as_ctrl_c_does(tmp_path, tiny_corpus):
    """`triax train ... | head -3`: no BrokenPipeError traceback; the run stops after the step it is
    in, writes a snapshot and says so on stderr; the same command again resumes from it."""
    run_dir = tmp_path / "run"
    overrides = " ".join(tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 400, "trainer.log_every": 1}))
    command = f"{sys.executable} -m triax train {overrides} | head -3"
    done = subprocess.run(["bash", "-c", command], env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert len(done.stdout.splitlines()) == 3, done.stdout
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert "its output was closed (the reader of the pipe ended): finishing the current step" in done.stderr
    assert "stopped by a closed output after step" in done.stderr, done.stderr
    snapshots = list((run_dir / "snapshots").glob("step_*"))
    assert len(snapshots) == 1 and snapshots[0].name != "step_00000400", snapshots
    again = train(tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 400, "trainer.eval_every": 0,
                                                          "trainer.log_every": 100}))
    assert f"resuming from {snapshots[0]}" in again.stdout, again.stdout


@pytest.mark.multiprocess
def test_one_step_is_one_step(tmp_path, tiny_corpus):
    done = train(tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.max_steps": 1}))
    assert " 1 step of 8 samples (" in done.stdout and "done: 1 step in" in done.stdout, done.stdout


@pytest.mark.parametrize("argv, option", [
    (["tokenize", "in.txt", "--out", "tokens", "--val", "v.txt"], "--val"),  # not --val-fraction
    (["eval", "runs/gpt", "--batch", "2"], "--batch"),  # not --batch-size
    (["generate", "runs/gpt", "--temp", "0.5"], "--temp"),  # not --temperature
    (["export", "runs/gpt", "out.safetensors", "--form", "hf"], "--form"),  # not --format
])
def test_no_command_takes_an_abbreviated_option(argv, option, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("some text\n")
    assert triax_main(argv) == 2
    error = capsys.readouterr().err
    assert f"unknown option '{option}' (options are taken only by their whole names)" in error, error
    assert error.count("\n") == 1


@pytest.mark.parametrize("key, meant", [("optim.learning_rate", "optim.lr"), ("trainer.max_iters", "trainer.max_steps"),
                                        ("trainer.gradient_accumulation_steps", "trainer.grad_accum")])
def test_another_tools_key_name_gets_triaxs(key, meant, capsys):
    assert triax_main(["train", f"{key}=1"]) == 2
    assert f"unknown key {key} (did you mean {meant}?)" in capsys.readouterr().err


def test_dtensors_warnings_stay_out_of_the_output_and_its_errors_do_not():
    """The `_NormPartial` paragraph DTensor logged once per rank of an FSDP x TP run: the record
    never reaches a handler (torch's own writes to the stderr it found at import)."""
    import torch.distributed.tensor._redistribute as redistribute  # its logger, as torch configured it

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    loggers = [logging.getLogger(name) for name in DTENSOR_LOGGERS]
    before = [list(logger.filters) for logger in loggers]
    kept = Kept()
    redistribute.logger.addHandler(kept)
    for logger in loggers:  # as torch left them (an earlier in-process `triax` call filtered them already)
        logger.filters[:] = []
    try:
        redistribute.logger.warning("before: shown")
        quiet_torch_logs(debug=False)
        redistribute.logger.warning("While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) ...")
        redistribute.logger.error("a real error")
        assert kept.messages == ["before: shown", "a real error"], kept.messages
    finally:
        redistribute.logger.removeHandler(kept)
        for logger, filters in zip(loggers, before):
            logger.filters[:] = filters


def test_a_nanogpt_checkpoint_without_an_evaluation_has_no_best_loss():
    """nanoGPT (and triax's export) store 1e9 until the first evaluation: no `best val loss 1000000000.0000`."""
    assert nanogpt_best(1e9, 20) is None and nanogpt_best(float("inf"), 20) is None and nanogpt_best(None, 0) is None
    assert nanogpt_best(torch.tensor(1.25), 20) == (1.25, 20)
