"""`triax bench` end to end on a tiny model with 1 and 2 processes: table, JSON and PNG."""

import json
import sys

import pytest

from triax.testing import quiet_env, run
from support import REPO_DIR

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess

REPO = REPO_DIR


def test_bench_runs_one_and_two_processes_and_writes_json_and_png(tmp_path):
    out = tmp_path / "bench"
    result = run([sys.executable, "-m", "triax", "bench", "--model", "gpt-nano", "--nproc", "1,2",
                  "--batch-size", "2", "--block-size", "16", "--warmup", "1", "--steps", "1",
                  "--repeats", "2", "--impls", "ddp,triax,accelerator,horovod,ddp-no-comm",
                  "--out", str(out)], timeout=300, cwd=REPO, env=quiet_env(PYTHONPATH=REPO))
    assert "samples/s" in result.stdout

    summary = json.loads((out / "bench.json").read_text())
    rows = {(row["impl"], row["processes"]): row for row in summary["rows"]}
    for impl in ("ddp", "triax"):
        for processes in (1, 2):
            row = rows[(impl, processes)]
            assert row["status"] == "ok", row
            assert row["repeats"] == 2 and row["step_time_min_s"] <= row["step_time_s"] <= row["step_time_max_s"]
            # 2 samples of 16 tokens per process per step.
            assert abs(row["tokens_per_s"] - 16 * row["samples_per_s"]) < 1e-6 * row["tokens_per_s"]
            assert abs(row["samples_per_s"] * row["step_time_s"] - 2 * processes) < 1e-6
            # Not < 1: on a shared CPU the peak is measured under load and can be below what a step gets.
            assert row["mfu"] > 0
        assert rows[(impl, 1)]["scaling_efficiency"] == 1.0
        assert rows[(impl, 2)]["scaling_efficiency"] > 0
    assert rows[("ddp", 1)]["time_vs_ddp"] == 1.0
    assert 0 <= rows[("ddp", 2)]["comm_share"] < 1
    assert rows[("ddp-no-comm", 1)]["status"].startswith("not available")
    # triax's own other doors must run: one that fails to import is a failure, not "not available".
    for impl in ("accelerator", "horovod"):
        for processes in (1, 2):
            assert rows[(impl, processes)]["status"] == "ok", rows[(impl, processes)]

    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

