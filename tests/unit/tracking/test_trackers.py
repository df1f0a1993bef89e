"""Trackers: a run logged to Weights & Biases (offline) and to MLflow (a local file store) holds the
same metrics as its metrics.jsonl, from `triax train` and from the Accelerator. The real libraries
run; what they stored is read back from their own files."""

import glob
import json
import os
import struct

import pytest

from support.helpers import tiny_overrides, train
from triax.testing import quiet_env

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


def offline_env(tmp_path) -> dict:
    """W&B offline under tmp_path/wandb, MLflow in tmp_path/mlruns: nothing leaves the machine."""
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}


def read_wandb_offline_run(wandb_dir) -> tuple[dict, dict]:
    """(history by step, config) of the one offline run under wandb_dir, read from its .wandb file
    (records in LevelDB's log format: 32 KiB blocks of chunks with a 7-byte header, each record a
    protobuf from wandb.proto)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    block, position, pending, records = 32768, 7, b"", []  # 7: the file's own header
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # a block's tail too short for a header is padding
            position += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            position += room
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(pending)
            pending = b""
    history, config = {}, {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.history.item}
            history[values["_step"]] = numbers(values)
        elif kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in items
                           if not item.key.startswith("_")})
    return history, config


def numbers(record: dict) -> dict:
    """A record's metrics: its numeric values, without the step and time (or W&B's _step...)."""
    return {key: value for key, value in record.items()
            if key not in ("step", "time") and not key.startswith("_")
            and isinstance(value, (int, float)) and not isinstance(value, bool)}


def read_mlflow_run(tracking_uri, experiment) -> tuple[dict, dict, str]:
    """(metrics by step, params, run name) of the one run in `experiment`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    metrics = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            metrics.setdefault(point.step, {})[key] = point.value
    return metrics, run.data.params, run.info.run_name


def jsonl_metrics(path) -> dict:
    """metrics.jsonl by step: the numeric values of each record (not its step and time)."""
    metrics = {}
    for line in open(path):
        record = json.loads(line)
        metrics[record["step"]] = numbers(record)
    return metrics


@pytest.mark.multiprocess
def test_train_logs_the_same_metrics_to_wandb_mlflow_and_jsonl(tmp_path, tiny_corpus, monkeypatch):
    run_dir = tmp_path / "run"
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)  # for the job, and for reading back here
    env = quiet_env()
    overrides = tiny_overrides(run_dir, tiny_corpus, **{
        "trainer.loggers": "[jsonl,wandb,mlflow]", "trainer.project": "shakespeare", "trainer.eval_every": 3,
        "trainer.run_name": "first"})
    train(overrides, nproc=2, env=env)  # two processes, one set of records: the main process logs

    logged = jsonl_metrics(run_dir / "metrics.jsonl")
    assert sorted(logged) == [2, 3, 4, 6] and "loss" in logged[2] and "val_loss" in logged[3]
    history, config = read_wandb_offline_run(tmp_path / "wandb")
    assert history == logged
    assert config["trainer"]["batch_size"] == 8 and config["model"]["n_embd"] == 32
    metrics, params, name = read_mlflow_run((tmp_path / "mlruns").as_uri(), "shakespeare")
    assert metrics == logged and name == "first"
    assert params["trainer.batch_size"] == "8" and params["model.n_layer"] == "2"
    assert not (run_dir / "tensorboard").exists()  # not asked for


def test_accelerator_logs_to_every_tracker_as_accelerate(tmp_path, monkeypatch):
    from triax.accelerate import Accelerator
    from triax.accelerate.state import AcceleratorState, GradientState

    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(log_with=["jsonl", "wandb", "mlflow"], project_dir=str(tmp_path / "logs"))
    accelerator.init_trackers("demo", config={"lr": 0.001, "layers": 2},
                              init_kwargs={"mlflow": {"run_name": "demo-run"}})
    assert isinstance(accelerator.get_tracker("wandb", unwrap=True), wandb.Run)
    assert accelerator.get_tracker("mlflow", unwrap=True).info.run_name == "demo-run"
    with pytest.raises(ValueError, match="tensorboard is not an available tracker"):
        accelerator.get_tracker("tensorboard")
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "accuracy": 0.25 * step})
    accelerator.end_training()
    # run.finish() (what end_training calls, as Accelerate does) only tells wandb's service process
    # that the run is over: the service writes the .wandb file in 32 KiB blocks and writes the last
    # one when it closes the run, after finish has returned. wandb.teardown() waits for the service
    # to close every run and exit, as the interpreter's exit does; a run trained in a process of
    # its own (the test above) is read only after that process has exited.
    wandb.teardown()

    logged = jsonl_metrics(tmp_path / "logs" / "demo" / "metrics.jsonl")
    assert logged == {step: {"loss": 1.0 / (step + 1), "accuracy": 0.25 * step} for step in range(3)}
    history, config = read_wandb_offline_run(tmp_path / "wandb")
    assert history == logged and config == {"lr": 0.001, "layers": 2}
    metrics, params, _ = read_mlflow_run((tmp_path / "mlruns").as_uri(), "demo")
    assert metrics == logged and params == {"lr": "0.001", "layers": "2"}


def test_log_with_follows_accelerate(monkeypatch):
    from triax.accelerate.tracking import parse_log_with
    from triax.tracking.trackers import TRACKERS

    class Mine:  # a tracker object of the user's own is kept as it is
        name = "mine"

        def log(self, values, step=None):
            pass

        def finish(self):
            pass

    mine = Mine()
    assert parse_log_with(["wandb", "wandb", mine]) == [mine, "wandb"]
    assert parse_log_with("all") == list(TRACKERS)  # everything installed here
    with pytest.raises(ValueError, match="Unsupported logging capability: 'nope'"):
        parse_log_with("nope")
    with pytest.warns(UserWarning, match="no 'comet_ml' tracker"):
        assert parse_log_with(["comet_ml", "jsonl"]) == ["jsonl"]
    monkeypatch.setattr("triax.tracking.trackers.importlib.util.find_spec", lambda name: None)
    with pytest.warns(UserWarning, match=r"pip install 'triax\[mlflow\]'"):
        assert parse_log_with(["mlflow", "jsonl"]) == ["jsonl"]  # Accelerate leaves it out too
    assert parse_log_with("all") == ["jsonl"]


def test_a_tracker_that_is_missing_or_cannot_start_is_one_line(tmp_path, monkeypatch):
    from triax.errors import ConfigError, TriaxError
    from triax.tracking.trackers import check_trackers, open_tracker

    with pytest.raises(ConfigError, match="'neptune' is not a tracker triax has"):
        check_trackers(["jsonl", "neptune"], "trainer.loggers")
    with pytest.raises(ConfigError, match="jsonl named more than once"):
        check_trackers(["jsonl", "jsonl"], "trainer.loggers")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nowhere://tracking")  # no store of that kind exists
    with pytest.raises(TriaxError, match=r"cannot start the mlflow run \(.*nowhere.*MLFLOW_TRACKING_URI") as caught:
        open_tracker("mlflow", str(tmp_path), "demo")
    assert "\n" not in str(caught.value) and isinstance(caught.value, RuntimeError)
    monkeypatch.setattr("triax.tracking.trackers.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs the wandb package; install it with: pip install 'triax\[wandb\]'"):
        check_trackers(["wandb"], "trainer.loggers")


def test_logger_type_has_accelerate_members():
    accelerate_utils = pytest.importorskip("accelerate.utils")
    from triax.accelerate.tracking import parse_log_with
    from triax.accelerate.utils import LoggerType

    assert [m.value for m in LoggerType] == [m.value for m in accelerate_utils.LoggerType]
    assert parse_log_with([LoggerType.TENSORBOARD, accelerate_utils.LoggerType.MLFLOW]) == ["tensorboard", "mlflow"]
