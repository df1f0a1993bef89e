"""Where a run's metrics go: metrics.jsonl, TensorBoard, Weights & Biases, MLflow.

One tracker class per destination, each with the same four parts (Accelerate's `GeneralTracker`
contract, so the Accelerator can hand them out as they are): `name`, `tracker` (the object
underneath: a SummaryWriter, a W&B run, an MLflow run), `store_init_configuration(config)`, and
`log(values, step)`; `finish()` ends it. Only the main process opens trackers; `triax train` and the
Accelerator both come here, so each destination is written the same way by both doors.

Weights & Biases and MLflow are optional extras (`pip install 'triax[wandb]'`, `'triax[mlflow]'`),
imported only when asked for. Both read their own environment as they always do: WANDB_MODE,
WANDB_DIR, WANDB_PROJECT, WANDB_RUN_ID...; MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME...
Nothing here talks to a server unless that environment says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from typing import Any, Iterable

from triax import safe_files
from triax.errors import ConfigError, TriaxError

TRACKERS = ("tensorboard", "jsonl", "wandb", "mlflow")
# The package each tracker imports; the optional ones come with triax's extra of the same name.
PACKAGES = {"tensorboard": "tensorboard", "jsonl": None, "wandb": "wandb", "mlflow": "mlflow"}
EXTRAS = ("wandb", "mlflow")

# MLflow's limits on parameters (mlflow.utils.validation): values are cut to this many characters,
# and one call sends at most this many.
MLFLOW_PARAM_CHARS = 6000
MLFLOW_PARAMS_PER_CALL = 100


# What to check when a tracker cannot start.
START_HINTS = {
    "wandb": "log in with `wandb login`, or set WANDB_MODE=offline to log without a server",
    "mlflow": "check MLFLOW_TRACKING_URI (a local store: file:///path/mlruns with MLFLOW_ALLOW_FILE_STORE=true, "
              "or sqlite:///mlflow.db with the full mlflow package)",
}


class TrackerError(TriaxError, RuntimeError):
    """A tracker's library could not start its run."""


def is_available(name: str) -> bool:
    package = PACKAGES[name]
    return package is None or importlib.util.find_spec(package) is not None


def available_trackers() -> list[str]:
    """The trackers whose packages are installed (what log_with="all" means, as in Accelerate)."""
    return [name for name in TRACKERS if is_available(name)]


def install_hint(name: str) -> str:
    """The command that installs a tracker's package."""
    return f"pip install 'triax[{name}]'" if name in EXTRAS else f"pip install {PACKAGES[name]}"


def check_trackers(names: Iterable[str], where: str) -> list[str]:
    """The tracker names, checked: known, not repeated, and their package installed. One line
    naming the extra to install otherwise (raised before anything starts)."""
    names = list(names)
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"{where}: {name!r} is not a tracker triax has; use any of {', '.join(TRACKERS)}")
        if not is_available(name):
            raise ConfigError(f"{where}: the {name!r} tracker needs the {PACKAGES[name]} package; "
                              f"install it with: {install_hint(name)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"{where}: {', '.join(repeated)} named more than once")
    return names


def _plain(values: dict) -> dict:
    # 0-d tensors as the numbers they hold, so a record is plain JSON.
    return {key: value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value
            for key, value in values.items()}


def numbers_only(values: dict) -> dict:
    """The values a metric store takes: real numbers (and 0-d tensors), not strings or bools."""
    return {key: value for key, value in _plain(values).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def flatten(config: dict, prefix: str = "") -> dict:
    """{"trainer": {"lr": 1}} -> {"trainer.lr": 1}: MLflow's parameters are flat."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class Tracker:
    """What every tracker provides (Accelerate's GeneralTracker contract)."""

    name = ""
    main_process_only = True  # Accelerate's attribute: triax opens trackers on the main process only
    _next_step = 0  # the step of the next record logged without one

    @property
    def tracker(self):
        return None

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def _numbered(self, step: int | None) -> int:
        # A record logged without a step gets the one after the last (MLflow would otherwise file
        # every such point under step 0; metrics.jsonl needs a step in each record).
        step = self._next_step if step is None else step
        self._next_step = step + 1
        return step


class JsonlTracker(Tracker):
    """<directory>/metrics.jsonl: one JSON object per logged step, triax's own run record."""

    name = "jsonl"

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "metrics.jsonl")
        safe_files.make_directory(directory)
        self._handle = safe_files.open_append(self.path)  # never through a planted link, never a FIFO

    @property
    def tracker(self):
        return self._handle

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        step = self._numbered(step)
        if self._handle is None:
            return
        record = {"step": step, **_plain(values), "time": round(time.time(), 3)}
        try:
            self._handle.write(json.dumps(record, default=str) + "\n")  # line-buffered: written out here
        except OSError as error:
            # A full disk: say so once, stop writing metrics, keep training (only rank 0 logs,
            # so raising here would leave the other ranks waiting in the next collective).
            print(f"triax: warning: cannot append to {self.path!r} ({error.strerror or error}); "
                  "metrics.jsonl is no longer written for this run", file=sys.stderr, flush=True)
            self.finish()

    def finish(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            with contextlib.suppress(OSError):  # a write it could not finish was reported when made
                handle.close()


class TensorBoardTracker(Tracker):
    """TensorBoard event files in `directory` (`tensorboard --logdir runs`)."""

    name = "tensorboard"

    def __init__(self, directory: str, **kwargs: Any):
        from torch.utils.tensorboard import SummaryWriter  # deferred: only runs that ask for it pay the import

        self.writer = SummaryWriter(safe_files.make_directory(directory), **kwargs)

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values: dict) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(values, indent=1, default=str) + "\n```")

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        numbers = numbers_only(values)
        if kwargs:  # add_scalar's own options (walltime, new_style, ...): its own path
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, step, **kwargs)
        elif numbers:
            # One event holding every value of the step: what add_scalar writes per value (a
            # simple_value), at a seventh of the cost (~0.6 ms a record of ten values is 1% of a
            # small model's CPU step when every step is logged).
            from tensorboard.compat.proto.summary_pb2 import Summary  # deferred: as SummaryWriter, above

            summary = Summary(value=[Summary.Value(tag=key, simple_value=float(value))
                                     for key, value in numbers.items()])
            self.writer._get_file_writer().add_summary(summary, step)
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, step)

    def finish(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run. WANDB_MODE=offline writes it under WANDB_DIR for `wandb sync`."""

    name = "wandb"

    def __init__(self, project: str, run_name: str | None = None, directory: str | None = None, **kwargs: Any):
        import wandb  # deferred: an optional extra

        kwargs.setdefault("project", os.environ.get("WANDB_PROJECT", project))
        if run_name is not None:
            kwargs.setdefault("name", run_name)
        if directory is not None and "WANDB_DIR" not in os.environ:
            kwargs.setdefault("dir", safe_files.make_directory(directory))
        self.run = wandb.init(**kwargs)

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(Tracker):
    """An MLflow run in the experiment named `project` (MLFLOW_EXPERIMENT_NAME wins), stored where
    MLFLOW_TRACKING_URI says (MLflow's default otherwise)."""

    name = "mlflow"

    def __init__(self, project: str, run_name: str | None = None, **kwargs: Any):
        import mlflow  # deferred: an optional extra

        self.mlflow = mlflow
        if "nested_run" in kwargs:  # Accelerate's name for mlflow.start_run's `nested`
            kwargs["nested"] = kwargs.pop("nested_run")
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", project)
        if "experiment_id" not in kwargs:
            found = mlflow.get_experiment_by_name(experiment)
            kwargs["experiment_id"] = found.experiment_id if found else mlflow.create_experiment(experiment)
        if run_name is not None:
            kwargs.setdefault("run_name", run_name)
        self.run = mlflow.start_run(**kwargs)

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        params = [(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in flatten(values).items()]
        for start in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.mlflow.log_params(dict(params[start:start + MLFLOW_PARAMS_PER_CALL]))

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        step = self._numbered(step)  # W&B counts steps itself; MLflow does not
        metrics = numbers_only(values)
        if metrics:
            self.mlflow.log_metrics(metrics, step=step, **kwargs)

    def finish(self) -> None:
        self.mlflow.end_run()


def open_tracker(name: str, directory: str, project: str, run_name: str | None = None,
                 options: dict | None = None) -> Tracker:
    """One tracker by name, writing its files (if any) under `directory` (TensorBoard's in its
    tensorboard/ folder); `options` go to the library's own call (SummaryWriter, wandb.init,
    mlflow.start_run)."""
    check_trackers([name], "tracker")  # known, and its package installed
    options = dict(options or {})
    if name == "jsonl":
        return JsonlTracker(directory)
    if name == "tensorboard":
        return TensorBoardTracker(os.path.join(directory, "tensorboard"), **options)
    try:
        if name == "wandb":
            return WandbTracker(project, run_name, directory, **options)
        return MLflowTracker(project, options.pop("run_name", run_name), **options)
    except Exception as error:  # the library's own failure (no login, unreachable server...): one line
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        raise TrackerError(f"cannot start the {name} run ({type(error).__name__}: {first_line}); "
                           f"{START_HINTS[name]}") from error
