"""What `triax train` tells the person watching it: the first line names what was loaded, each log
line the time left, the last line a summary; progress bars (steps, tokens/s, time left) on a
terminal only, for train, eval, tokenize and export."""

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from support.helpers import tiny_overrides, train
from triax.testing import quiet_env


@pytest.mark.multiprocess
def test_first_line_names_the_checkpoint_a_run_started_from(tmp_path, tiny_corpus):
    from support.gpt2_checkpoints import build_gpt2

    build_gpt2(tmp_path / "gpt2", tiny_corpus, tie=False)
    output = train(tiny_overrides(tmp_path / "run", tiny_corpus, **{"model.init_from": tmp_path / "gpt2",
                                                                    "trainer.max_steps": 2})).stdout
    first = output.splitlines()[0]
    assert first.startswith(f"training from {tmp_path / 'gpt2'} (gpt2, ") and "gpt-micro" not in first, first


@pytest.mark.multiprocess
def test_first_line_names_the_architecture_a_preset_is_built_as(tmp_path, tiny_corpus):
    output = train(tiny_overrides(tmp_path / "run", tiny_corpus, **{"model.arch": "qwen2",
                                                                    "trainer.max_steps": 1})).stdout
    first = output.splitlines()[0]
    assert first.startswith("training ") and " (qwen2, " in first, first


@pytest.mark.multiprocess
def test_log_lines_say_the_time_left_and_the_run_ends_with_a_summary(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    output = train(tiny_overrides(run_dir, tiny_corpus, **{"trainer.eval_every": 2, "trainer.eval_batches": 1,
                                                           "trainer.log_every": 2})).stdout
    steps = [line for line in output.splitlines() if line.startswith("step ")]
    assert all(re.search(r" \| \d+(m\d\ds|s) left$", line) for line in steps[:-1]), steps
    assert not steps[-1].endswith("left")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "val_loss" in line]
    best = min(records, key=lambda record: record["val_loss"])
    summary = output.strip().splitlines()[-1]
    assert re.fullmatch(rf"done: 6 steps in \d+s \([\d,]+ tokens/s\); best val_loss {best['val_loss']:.4f} "
                        rf"\(step {best['step']}\); snapshot \S+step_00000006; logs {run_dir}/metrics.jsonl, "
                        rf"{run_dir}/tensorboard", summary), summary


def on_a_terminal(command, cwd):
    """(exit code, everything written) of `command` with a pseudo-terminal as stdout and stderr."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # 50 rows, 200 columns
    process = subprocess.Popen(command, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL,
                               env=quiet_env(), cwd=cwd)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return process.wait(timeout=300), b"".join(chunks).decode(errors="replace")


@pytest.mark.multiprocess
def test_progress_bars_show_on_a_terminal(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    code, shown = on_a_terminal([sys.executable, "-m", "triax", "train", *tiny_overrides(run_dir, tiny_corpus)],
                                tmp_path)
    assert code == 0, shown[-3000:]
    # tqdm's bar: steps done of the total, the time spent, the loss, and the run's tokens/s and
    # time left: after each log line the bar is drawn again, with the line's own figures.
    lines = re.findall(r"step (\d)/6 \| .*? \| ([\d,]+) tok/s \| .*? \| (\d+(?:m\d\d)?s) left", shown)
    assert len(lines) == 2, shown[-3000:]  # steps 2 and 4 (the last line has no time left)
    for step, speed, left in lines:
        after = shown[shown.index(f"step {step}/6 |"):]
        bar = re.search(rf"{step}/6 \[\d\d:\d\d, loss=[\d.]+, speed=([\d,]+) tok/s, left=(\S+?)\]", after)
        assert bar and bar.groups() == (speed, left), (step, speed, left, after[:600])
    code, shown = on_a_terminal([sys.executable, "-m", "triax", "export", str(run_dir),
                                 str(tmp_path / "model.safetensors")], tmp_path)
    assert code == 0 and "export:" in shown, shown[-3000:]
    code, shown = on_a_terminal([sys.executable, "-m", "triax", "eval", str(run_dir), "--split", "train", "--batch-size", "1"],
                                tmp_path)
    assert code == 0 and re.search(r"batch/s, tokens_per_s=[\d,]+\]", shown), shown[-3000:]
