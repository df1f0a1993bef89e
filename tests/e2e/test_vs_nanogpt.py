"""benchmarks/vs_nanogpt.py's bookkeeping (not its timings): how a run's time-stamped lines are cut
into steps, evaluation and snapshots, the nanoGPT data it writes, and its behaviour without a checkout."""

import importlib.util
import os
import pickle

import numpy as np
import pytest
from support import REPO_DIR

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(REPO_DIR, "benchmarks", "vs_nanogpt.py")
    spec = importlib.util.spec_from_file_location("vs_nanogpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_checkout_it_says_so_and_exits_cleanly(bench, monkeypatch, capsys):
    monkeypatch.delenv("NANOGPT_DIR", raising=False)
    bench.main([])
    assert "skipped: no nanoGPT checkout" in capsys.readouterr().out


def test_a_directory_that_is_not_nanogpt_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit, match="lacks train.py"):
        bench.main(["--nanogpt", str(tmp_path)])


def test_nanogpt_lines_split_into_steps_evaluation_and_snapshots(bench):
    # nanoGPT: set-up, an evaluation before step 0, steps of 0.1 s, then at step 3 an evaluation
    # (0.5 s), a save notice and a save (0.3 s) before that step's line.
    lines = [(1.0, "number of parameters: 0.80M"), (1.4, "step 0: train loss 4.2, val loss 4.2"),
             (1.5, "iter 0: loss 4.2"), (1.6, "iter 1: loss 4.1"), (1.7, "iter 2: loss 4.0"),
             (2.2, "step 3: train loss 3.0, val loss 3.1"), (2.2, "saving checkpoint to out"),
             (2.6, "iter 3: loss 3.0"), (2.7, "iter 4: loss 2.9")]
    row = bench.split_seconds(lines, r"iter (\d+): loss", r"^step \d+: train loss", r"^saving checkpoint")
    assert row["median_step_s"] == pytest.approx(0.1)
    assert row["eval_s"] == pytest.approx(0.4 + 0.5)     # the evaluation before step 0, and step 3's
    assert row["snapshot_s"] == pytest.approx(0.3)       # the gap after the notice, less one step
    assert row["first_step_s"] == pytest.approx(1.5 - 0.4)  # the first evaluation is not start-up


def test_triax_lines_split_into_steps_evaluation_and_snapshots(bench):
    # triax: evaluation (and its sample) before step 250's line; the snapshot after it.
    step = 0.1
    lines = [(2.0 + step * i, f"step {i}/300 | loss 1") for i in range(1, 250)]
    # step 249 ends at 26.9; step 250 takes a step and 0.6 s of evaluation; 0.2 s of snapshot follow it
    lines += [(27.59, "--- sample at step 250 ---"), (27.6, "step 250/300 | loss 1 | val_loss 2")]
    lines += [(27.6 + 0.2 + step * (i - 250), f"step {i}/300 | loss 1") for i in range(251, 260)]
    row = bench.split_seconds(lines, r"step (\d+)/\d+ \|", r"^--- sample at step", None)
    assert row["eval_s"] == pytest.approx(0.6, abs=1e-9)
    assert bench.snapshot_seconds(lines, row["median_step_s"]) == pytest.approx(0.2, abs=1e-9)


def test_nanogpt_data_is_the_sorted_characters_split_nine_to_one(bench, tmp_path):
    text = "hello world, " * 100
    bench.write_nanogpt_data(text, str(tmp_path))
    with open(tmp_path / "meta.pkl", "rb") as handle:
        meta = pickle.load(handle)
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "val.bin", dtype=np.uint16)
    assert meta["vocab_size"] == len(set(text)) and sorted(meta["stoi"]) == list(meta["stoi"])
    assert len(train) == int(len(text) * 0.9) and len(train) + len(val) == len(text)
    assert "".join(meta["itos"][int(i)] for i in np.concatenate([train, val])) == text
