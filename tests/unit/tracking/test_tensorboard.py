"""TensorBoard: what a run's event files hold, read back with TensorBoard's own reader, equals what
was logged (metrics.jsonl for `triax train`)."""

import json
import math

import numpy as np
import pytest

from support.helpers import tiny_overrides, train
from triax.tracking.trackers import TensorBoardTracker

pytest.importorskip("tensorboard")


def read_scalars(directory) -> dict:
    """{step: {tag: value}} of the event files under directory (TensorBoard's EventAccumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            scalars.setdefault(event.step, {})[tag] = event.value
    return scalars


def float32(value) -> float:
    return float(np.float32(value))  # TensorBoard stores simple values as float32


def test_the_tracker_stores_every_number_it_is_given(tmp_path):
    tracker = TensorBoardTracker(str(tmp_path))
    records = {step: {"loss": 3.0 / (step + 1), "lr": 1e-3 * step, "tokens": 100 + step, "note": "text",
                      "done": True} for step in range(5)}
    for step, record in records.items():
        tracker.log(record, step)
    tracker.log({"extra": 0.5}, 7, walltime=1.0e9)  # add_scalar's own options take its own path
    tracker.finish()
    expected = {step: {key: float32(value) for key, value in record.items() if key in ("loss", "lr", "tokens")}
                for step, record in records.items()}
    expected[7] = {"extra": 0.5}
    assert read_scalars(tmp_path) == expected


def test_a_runs_event_files_equal_its_metrics_jsonl(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{"trainer.eval_every": 3}))
    logged = {}
    for line in open(run_dir / "metrics.jsonl"):
        record = json.loads(line)
        logged[record["step"]] = {key: float32(value) for key, value in record.items()
                                  if isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and key not in ("step", "time") and math.isfinite(value)}
    assert sorted(logged) == [2, 3, 4, 6] and "val_loss" in logged[3] and "loss" in logged[2]
    assert read_scalars(run_dir / "tensorboard") == logged
