"""Every bad input gives one clear line, a non-zero exit, no traceback, and leaves nothing behind."""

import os
import subprocess
import sys

import pytest

from triax.commands.cli import main as triax_main
from triax.testing import quiet_env

from support.helpers import tiny_overrides


def run_cli(capsys, args):
    code = triax_main(args)
    captured = capsys.readouterr()
    return code, captured.err.strip()


@pytest.fixture
def empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    return str(path)


CASES = {
    # name: (overrides that break, words the message must contain)
    "missing data file": (["data.path=/nonexistent/input.txt"], ["data.path", "/nonexistent/input.txt", "does not exist"]),
    "block_size too large": (["data.block_size=100000"], ["data.block_size=100000", "smaller"]),
    "n_embd not divisible": (["model.n_embd=30", "model.n_head=4"], ["n_embd=30", "n_head=4"]),
    "unknown preset": (["model=gpt5"], ["gpt5", "presets are"]),
    "unknown key": (["trainer.colour=red"], ["unknown key trainer.colour"]),
    "wrong type": (["trainer.max_steps=many"], ["trainer.max_steps", "many"]),
    "fp16 on cpu": (["trainer.precision=fp16", "trainer.device=cpu"], ["fp16", "bf16"]),
    "unknown precision": (["trainer.precision=fp8"], ["fp8"]),
    "unwritable run dir": (["trainer.run_dir=/proc/triax_run"], ["trainer.run_dir", "/proc/triax_run", "not writable"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_clear_line(name, capsys, tmp_path, tiny_corpus):
    breaking, words = CASES[name]
    run_dir = tmp_path / "run"
    args = ["train", *tiny_overrides(run_dir, tiny_corpus), *breaking]
    code, err = run_cli(capsys, args)
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith("triax: error:")
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"
    if "run_dir" not in " ".join(breaking):
        assert not run_dir.exists(), "a failed start left a run directory behind"


def test_empty_data_file(capsys, tmp_path, empty_file):
    code, err = run_cli(capsys, ["train", *tiny_overrides(tmp_path / "run", empty_file)])
    assert code != 0 and "is empty" in err and empty_file in err


@pytest.mark.multiprocess
def test_real_command_exits_nonzero_without_traceback_and_debug_shows_it(tmp_path):
    args = [sys.executable, "-m", "triax", "train", "data.path=/nonexistent.txt",
            f"trainer.run_dir={tmp_path / 'run'}"]
    result = subprocess.run(args, capture_output=True, text=True, env=quiet_env(), timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "/nonexistent.txt" in result.stderr
    debug = subprocess.run(args + ["--debug"], capture_output=True, text=True, env=quiet_env(), timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_an_interrupt_says_what_the_trainer_said(monkeypatch, capsys):
    """The trainer's second Ctrl-C carries where a restart will begin; `triax` prints it."""
    import triax.commands.cli

    def interrupted(argv):
        raise KeyboardInterrupt("stopped in step 3 without a snapshot of it: a restart resumes from R (step 2)")

    monkeypatch.setattr(triax.commands.cli, "run_command", interrupted)
    assert triax_main(["train"]) == 130
    assert capsys.readouterr().err == ("triax: interrupted; stopped in step 3 without a snapshot of it: a restart "
                                       "resumes from R (step 2)\n")


def test_a_context_no_host_could_hold_stops_before_anything_is_allocated(tmp_path):
    """data.block_size=100000 on the built-in corpus once ran for ten minutes, growing to 8.8 GB,
    before anything was printed: now one line naming the key and this host's memory."""
    from support.forked import launch

    result = launch(1, ["-m", "triax", "train", "data.block_size=100000", f"trainer.run_dir={tmp_path / 'run'}"],
                    timeout=120, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("triax: error: data.block_size=100000 with trainer.batch_size=32 "
                                                   "needs"), result.stderr
    assert "GiB of activations" in lines[0] and "but this host has" in lines[0]
    assert not (tmp_path / "run").exists()


def test_generate_help_speaks_of_tokens(capsys):
    """--greedy takes the most likely token: a BPE run's tokens are not characters."""
    with pytest.raises(SystemExit):
        triax_main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "always take the most likely token (a character in a character-level run)" in text


def test_a_start_that_finds_the_disk_full_leaves_nothing_behind(tmp_path, tiny_corpus, capsys, monkeypatch):
    """ENOSPC while writing the run files: one line, and no partly written run (an empty
    metrics.jsonl, a tensorboard folder, the lock) left in the directory it created."""
    import errno

    from triax import safe_files

    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(safe_files, "write_atomic", disk_full)
    run_dir = tmp_path / "run"
    code, err = run_cli(capsys, ["train", *tiny_overrides(run_dir, tiny_corpus)])
    assert code == 2 and len(err.splitlines()) == 1 and "No space left on device" in err, err
    assert not run_dir.exists(), sorted(os.listdir(run_dir))


def test_names_reach_the_terminal_escaped(tmp_path, tiny_corpus, capsys):
    """A run directory named with an escape sequence (quoted for Hydra) trains, and its name is
    printed escaped: a name from a config must not recolour or rewrite the user's terminal."""
    run_dir = tmp_path / "a\x1b[31mred"
    overrides = [override for override in tiny_overrides(tmp_path, tiny_corpus, **{"trainer.max_steps": 2})
                 if not override.startswith("trainer.run_dir=")]
    assert triax_main(["train", *overrides, f'trainer.run_dir="{run_dir}"']) == 0
    output = capsys.readouterr()
    assert "\x1b" not in output.out + output.err
    assert "a\\x1b[31mred" in output.out and run_dir.is_dir()


def test_a_non_ascii_run_directory_needs_no_quotes(tmp_path, tiny_corpus, capsys):
    """Paths are text: Hydra's grammar refuses `ü` in an unquoted value, triax quotes it."""
    run_dir = tmp_path / "rün_日本語"
    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})]) == 0
    assert (run_dir / "snapshots").is_dir()


def test_printable_escapes_what_a_terminal_would_act_on():
    from triax.errors import printable

    assert printable("runs/a\x1b[31mred\u202etxt.exe\r") == "runs/a\\x1b[31mred\\u202etxt.exe\\r"
    assert printable("rün_日本語　x") == "rün_日本語　x"  # letters and an ideographic space are text
    assert printable("line one\nline\ttwo\x07", keep="\n\t") == "line one\nline\ttwo\\x07"
