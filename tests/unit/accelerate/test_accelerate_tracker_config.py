"""init_trackers(config=...) records the run's configuration as Accelerate's trackers record it:
TensorBoard's HPARAMS (add_hparams) and hparams.yml, MLflow's parameters (the keys as given, a
value too long for MLflow left out). Each is checked against Accelerate's own tracker class
writing the same values side by side."""

import glob
import os

import pytest
import yaml

accelerate_tracking = pytest.importorskip("accelerate.tracking")

CONFIG = {"learning_rate": 3e-4, "batch_size": 32, "model": "gpt2", "use_bf16": True, "note": None}


def started(tracker):
    if hasattr(tracker, "start"):
        tracker.start()
    return tracker


def hparams_of(directory):
    """The hparams each run under `directory` recorded (TensorBoard's hparams plugin data)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    recorded = []
    for events in sorted(glob.glob(os.path.join(directory, "**", "events.out.tfevents.*"), recursive=True)):
        accumulator = EventAccumulator(events)
        accumulator.Reload()
        try:
            contents = accumulator.PluginTagToContent("hparams")
        except KeyError:  # the run's own event file: scalars only
            continue
        for tag, content in contents.items():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.WhichOneof("data") == "session_start_info":
                values = data.session_start_info.hparams
                recorded.append({key: getattr(values[key], values[key].WhichOneof("kind")) for key in values})
    return recorded


def test_tensorboard_records_hparams_and_hparams_yml_as_accelerate(tmp_path, fresh_state):
    from triax.accelerate.tracking import TensorBoardTracker

    config = {key: value for key, value in CONFIG.items() if value is not None}  # add_hparams takes no None
    for name, tracker_class in (("ours", TensorBoardTracker), ("theirs", accelerate_tracking.TensorBoardTracker)):
        tracker = started(tracker_class("run", str(tmp_path / name)))
        tracker.store_init_configuration(config)
        tracker.finish()
    ours, theirs = (hparams_of(str(tmp_path / name / "run")) for name in ("ours", "theirs"))
    assert ours == theirs and len(ours) == 1 and ours[0]["model"] == "gpt2"
    files = [glob.glob(str(tmp_path / name / "run" / "*" / "hparams.yml")) for name in ("ours", "theirs")]
    assert all(len(found) == 1 for found in files)
    assert open(files[0][0]).read() == open(files[1][0]).read()
    assert yaml.safe_load(open(files[0][0])) == config


def test_mlflow_records_the_same_parameters_as_accelerate(tmp_path, monkeypatch, fresh_state):
    mlflow = pytest.importorskip("mlflow")
    from triax.accelerate.tracking import MLflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    config = {**CONFIG, "nested": {"depth": 2}, "long": "x" * (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH + 1)}
    recorded = {}
    for name, tracker_class in (("ours", MLflowTracker), ("theirs", accelerate_tracking.MLflowTracker)):
        tracker = started(tracker_class(f"experiment_{name}"))
        run_id = mlflow.active_run().info.run_id
        if name == "ours":
            with pytest.warns(UserWarning, match="long"):
                tracker.store_init_configuration(config)
        else:
            tracker.store_init_configuration(config)
        tracker.finish()
        recorded[name] = mlflow.get_run(run_id).data.params
    assert recorded["ours"] == recorded["theirs"]
    assert recorded["ours"]["nested"] == "{'depth': 2}" and "long" not in recorded["ours"]
