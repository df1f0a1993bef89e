"""Experiment tracking for the Accelerator: accelerate.tracking's counterpart, over triax.tracking.trackers.

As in Accelerate: `log_with` takes a tracker name, a `LoggerType`, a tracker object of your own (a
GeneralTracker subclass, triax's or Accelerate's: anything with `log` and `finish`), a list of
those, or "all" (every tracker whose package is installed). A name resolves to a tracker class
through LOGGER_TYPE_TO_CLASS, which register_tracker_class extends (Accelerate's own registry is
read too, so a class registered there is found). `init_trackers` makes each named tracker with
(project_name, logging_dir) when its class `requires_logging_directory`, else (project_name,),
then calls every tracker's `start()`, then `store_init_configuration(config)`. Trackers exist on
the main process only.

A name Accelerate knows but triax has no tracker for (Aim, Comet, ...) is left out with a warning,
as is a tracker whose package is not installed; a name nobody knows is a ValueError.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import yaml

import triax.safe_files as safe_files
from triax.accelerate._internal.errors import AcceleratorValueError
from triax.accelerate._internal.surface import serve_absent
from triax.accelerate.state import PartialState
from triax.accelerate.utils.dataclasses import LoggerType
from triax.errors import TriaxError
from triax.tracking import trackers as core

__all__ = ["GeneralTracker", "JsonlTracker", "LOGGER_TYPE_TO_CLASS", "MLflowTracker", "TensorBoardTracker",
           "WandBTracker", "filter_trackers", "get_available_trackers", "on_main_process", "register_tracker_class"]

# Trackers Accelerate has and triax does not: named in log_with, they are left out with a warning.
ACCELERATE_ONLY = ("aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio")


def on_main_process(function: Callable):
    """Decorator for a tracker's methods: when the tracker's `main_process_only` is true, only the
    main process runs the method (the others get None). Read at call time, so making a tracker
    does not need the process state."""

    @functools.wraps(function)
    def run(self, *args: Any, **kwargs: Any):
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return run


class GeneralTracker:
    """The base of a tracker (Accelerate's contract). A subclass defines `name`,
    `requires_logging_directory` and a `tracker` property (the library's own object), and may
    override start (open the run; the Accelerator calls it in init_trackers), store_init_configuration,
    log and finish. main_process_only: its decorated methods run on the main process only."""

    main_process_only = True

    def __init__(self, _blank: bool = False):
        if _blank:
            return
        missing = [f"`{attribute}`" for attribute in ("name", "requires_logging_directory", "tracker")
                   if attribute not in dir(self)]
        if missing:
            raise TrackerClassError(f"the tracker class {type(self).__name__} lacks {', '.join(missing)}: define "
                                    "them in the class (name, requires_logging_directory, and a tracker property)")

    def start(self):
        """Open the run. Called by init_trackers, after the process state exists."""

    def store_init_configuration(self, values: dict):
        """Record `values` (a run's hyperparameters)."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any):
        """Record `values` at `step`."""

    def finish(self):
        """Close the run."""


class TrackerClassError(TriaxError, NotImplementedError):
    """A GeneralTracker subclass lacks one of the attributes every tracker has (Accelerate raises
    NotImplementedError here too)."""


class _CoreTracker(GeneralTracker):
    """A GeneralTracker over one of triax.tracking.trackers' destinations: the files `triax train` writes,
    written the same way. `start` opens it (on the main process)."""

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.logging_dir = None if logging_dir is None else os.fspath(logging_dir)
        self.init_kwargs = kwargs
        self.core = None

    @property
    def tracker(self):
        return self.core.tracker if self.core is not None else None

    @on_main_process
    def store_init_configuration(self, values: dict):
        self.core.store_init_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any):
        self.core.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self):
        if self.core is not None:
            self.core.finish()


class TensorBoardTracker(_CoreTracker):
    """TensorBoard event files in <logging_dir>/<run_name>; kwargs go to SummaryWriter."""

    name = "tensorboard"
    requires_logging_directory = True

    @on_main_process
    def start(self):
        self.core = core.TensorBoardTracker(os.path.join(self.logging_dir, self.run_name), **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        # As Accelerate records a run's configuration: TensorBoard's HPARAMS tab (add_hparams,
        # which writes a sub-run named by the time) and <logging_dir>/<run_name>/<time>/hparams.yml.
        self.core.tracker.add_hparams(values, metric_dict={})
        self.core.tracker.flush()
        directory = os.path.join(self.logging_dir, self.run_name, str(time.time()))
        safe_files.make_directory(directory)
        safe_files.write_atomic(os.path.join(directory, "hparams.yml"), yaml.dump(values))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any):
        # A dict of numbers is one chart of several lines (SummaryWriter.add_scalars), as Accelerate's.
        self.core.log({key: value for key, value in values.items() if not isinstance(value, dict)}, step, **kwargs)
        for key, value in values.items():
            if isinstance(value, dict):
                self.core.tracker.add_scalars(key, value, global_step=step, **kwargs)


class JsonlTracker(_CoreTracker):
    """triax's own run record: <logging_dir>/<run_name>/metrics.jsonl, one JSON object per step."""

    name = "jsonl"
    requires_logging_directory = True

    @on_main_process
    def start(self):
        self.core = core.JsonlTracker(os.path.join(self.logging_dir, self.run_name))


class WandBTracker(_CoreTracker):
    """A Weights & Biases run in the project `run_name`; kwargs go to wandb.init."""

    name = "wandb"
    requires_logging_directory = False
    main_process_only = False  # as Accelerate's: wandb decides per process

    @on_main_process
    def start(self):
        self.core = core.open_tracker("wandb", None, self.run_name, options=self.init_kwargs)


class MLflowTracker(_CoreTracker):
    """An MLflow run in the experiment `experiment_name` (MLFLOW_EXPERIMENT_NAME wins), with
    Accelerate's arguments: run_id, tags, nested_run, run_name, description go to mlflow.start_run."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str | None = None, logging_dir: str | None = None, run_id: str | None = None,
                 tags: dict | None = None, nested_run: bool = False, run_name: str | None = None,
                 description: str | None = None):
        options = {key: value for key, value in (("run_id", run_id), ("tags", tags), ("description", description),
                                                 ("run_name", run_name)) if value is not None}
        if nested_run:
            options["nested"] = True
        GeneralTracker.__init__(self)
        self.experiment_name, self.run_name, self.logging_dir = experiment_name, run_name, logging_dir
        self.init_kwargs, self.core = options, None

    @on_main_process
    def start(self):
        self.core = core.open_tracker("mlflow", None, self.experiment_name, options=self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict):
        # As Accelerate: the keys as given (triax train's own tracker flattens nested ones), and a
        # value longer than MLflow takes is left out with a warning (not cut).
        import mlflow  # deferred: an optional extra, already imported by start()

        limit = mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
        too_long = [name for name, value in values.items() if len(str(value)) > limit]
        if too_long:
            warnings.warn(f"MLflow takes parameter values of at most {limit} characters: {', '.join(too_long)} "
                          "left out of the run's parameters", stacklevel=2)
        kept = [(name, value) for name, value in values.items() if name not in too_long]
        batch = mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
        for start in range(0, len(kept), batch):
            mlflow.log_params(dict(kept[start:start + batch]))


LOGGER_TYPE_TO_CLASS: dict[str, type] = {tracker.name: tracker for tracker in
                                         (TensorBoardTracker, WandBTracker, MLflowTracker, JsonlTracker)}


def register_tracker_class(tracker_class: type) -> None:
    """Make a GeneralTracker subclass nameable in log_with by its `name` (before making the
    Accelerator). Registering a name again replaces the class, with a warning."""
    if not (isinstance(tracker_class, type) and _is_tracker_class(tracker_class)):
        raise AcceleratorValueError(f"register_tracker_class needs a GeneralTracker subclass, got {tracker_class!r}")
    if not getattr(tracker_class, "name", None):
        raise AcceleratorValueError(f"register_tracker_class: {tracker_class.__name__} has no `name`; give the class "
                                    "a non-empty name attribute")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise AcceleratorValueError(f"register_tracker_class: {tracker_class.__name__} has no "
                                    "`requires_logging_directory`; set it to True or False in the class")
    if tracker_class.name in LOGGER_TYPE_TO_CLASS:
        warnings.warn(f"register_tracker_class: the tracker name {tracker_class.name!r} was registered already; "
                      f"{tracker_class.__name__} replaces {LOGGER_TYPE_TO_CLASS[tracker_class.name].__name__}",
                      stacklevel=2)
    LOGGER_TYPE_TO_CLASS[tracker_class.name] = tracker_class


def _is_tracker_class(cls: type) -> bool:
    """A subclass of triax's GeneralTracker or of Accelerate's (when Accelerate is loaded)."""
    accelerate_tracking = sys.modules.get("accelerate.tracking")
    bases = (GeneralTracker, getattr(accelerate_tracking, "GeneralTracker", GeneralTracker))
    return issubclass(cls, bases)


def _is_tracker_object(candidate: Any) -> bool:
    return not isinstance(candidate, str) and callable(getattr(candidate, "log", None)) \
        and callable(getattr(candidate, "finish", None))


def tracker_class(name: str):
    """The class log_with=name makes: triax's registry first, then classes registered with
    Accelerate's own register_tracker_class; None if neither has it."""
    if name in LOGGER_TYPE_TO_CLASS:
        return LOGGER_TYPE_TO_CLASS[name]
    accelerate_registry = getattr(sys.modules.get("accelerate.tracking"), "LOGGER_TYPE_TO_CLASS", {})
    found = accelerate_registry.get(name)
    if found is not None and found.__module__ != "accelerate.tracking":  # the user's, not Accelerate's own
        return found
    return None


def get_available_trackers() -> list[str]:
    """The tracker names whose packages are installed (what log_with="all" starts)."""
    return core.available_trackers()


def parse_log_with(log_with: Any) -> list:
    """log_with as a list of tracker names and tracker objects (the user's), repeats removed."""
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    objects = [entry for entry in entries if _is_tracker_object(entry)]
    names = [str(getattr(entry, "value", entry)) for entry in entries if not _is_tracker_object(entry)]
    if LoggerType.ALL.value in names:
        return objects + get_available_trackers()
    chosen = []
    for name in names:
        registered = tracker_class(name)
        if name in core.TRACKERS and not core.is_available(name):
            warnings.warn(f"log_with={name!r}: its package is not installed, so it is left out "
                          f"(as Accelerate does); {core.install_hint(name)}", stacklevel=3)
        elif registered is None and name in ACCELERATE_ONLY:
            warnings.warn(f"triax has no {name!r} tracker; nothing is logged to it (triax logs to "
                          f"{', '.join(core.TRACKERS)})", stacklevel=3)
        elif registered is None:
            raise AcceleratorValueError(f"Unsupported logging capability: {name!r}; use any of "
                                        f"{', '.join(LOGGER_TYPE_TO_CLASS)}, 'all', a tracker object, or a name "
                                        "given to register_tracker_class")
        elif name not in chosen:
            chosen.append(name)
    return objects + chosen


def filter_trackers(log_with: Any, logging_dir: str | None = None) -> list:
    """parse_log_with, and a ValueError for a named tracker that writes files when there is no
    logging directory (checked when the Accelerator is made, before anything starts)."""
    chosen = parse_log_with(log_with)
    for name in chosen:
        if isinstance(name, str) and tracker_class(name).requires_logging_directory and logging_dir is None:
            raise AcceleratorValueError(f"Logging with `{name}` requires a `logging_dir`: pass "
                                        "Accelerator(project_dir=...) or ProjectConfiguration(logging_dir=...)")
    return chosen


def start_trackers(log_with: list, project_name: str, logging_dir: str | None, init_kwargs: dict) -> list:
    """The trackers for log_with, made and started (init_trackers' work, on the main process)."""
    started = []
    for entry in log_with:
        if isinstance(entry, str):
            cls = tracker_class(entry)
            options = init_kwargs.get(entry, {})
            entry = cls(project_name, logging_dir, **options) if cls.requires_logging_directory \
                else cls(project_name, **options)
        started.append(entry)
    for tracker in started:
        if callable(getattr(tracker, "start", None)):
            tracker.start()
    return started


__getattr__, __dir__ = serve_absent(__name__)
