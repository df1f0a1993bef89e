"""Composing a training config: Hydra joins the bundled YAML, the model preset and the command
line's `key=value` overrides into a TrainConfig (triax.config.schema); errors become one
line naming the key. Also the config's dictionary form (config.yaml of a run) and `--help`'s keys.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import textwrap
import typing
from typing import TYPE_CHECKING

import yaml

from triax.errors import ConfigError
from triax.models.config import PRESETS, preset_fields
from triax.runtime.place import detect_place
from triax.config.schema import TrainConfig, field_docs
from triax.config.strict import check_composed, check_overrides, quote_text_values, schema_keys, unknown_key_error
from triax.config.validate import validate

if TYPE_CHECKING:  # the type only: a run's configuration is composed before any checkpoint is read
    from triax.interop.foreign_run import ForeignRun


_registered = False


def _register_schema() -> None:
    """The schema, and the `model=<preset>` group made from triax.models.config.PRESETS (their one
    home; there are no YAML files for them)."""
    global _registered
    if not _registered:
        from hydra.core.config_store import ConfigStore  # deferred: start-up time (Hydra), as in _compose

        store = ConfigStore.instance()
        store.store(name="triax_schema", node=TrainConfig)
        for name in PRESETS:
            store.store(group="model", name=name, node={"name": name, **preset_fields(name)})
        _registered = True


def _model_presets() -> list[str]:
    return list(PRESETS)


def compose_config(overrides: list[str] | None = None) -> TrainConfig:
    """Compose the bundled YAML with `key=value` overrides into a checked TrainConfig. With
    trainer.continue_from, the checkpoint's own settings come first and the overrides win."""
    return compose_run(overrides)[0]


def compose_run(overrides: list[str] | None = None) -> tuple[TrainConfig, ForeignRun | None]:
    """compose_config's TrainConfig, and trainer.continue_from's run as it was opened for its
    settings (None without one), for the trainer to continue without opening it again."""
    overrides = quote_text_values(list(overrides or []))
    config = _compose(overrides)
    if not config.trainer.continue_from:
        return config, None
    run = _open_continued(config)
    return _compose(continuation_overrides(config, run)[0] + overrides), run


def _open_continued(config: TrainConfig) -> ForeignRun:
    """trainer.continue_from's run (triax/interop/formats.py), or one line saying why it is none."""
    path = config.trainer.continue_from
    if config.model.init_from:
        raise ConfigError(f"trainer.continue_from={path!r} and model.init_from={config.model.init_from!r} both name "
                          "a checkpoint to start from; give one (continue_from also carries the optimizer and step)")
    # deferred: start-up time; only a continued run reads another tool's files (transformers' among them)
    from triax.interop.formats import open_continuation

    run = open_continuation(path)
    if run is None:
        raise ConfigError(f"trainer.continue_from={path!r} is not nanoGPT's ckpt.pt (or an out_dir holding one) "
                          "nor a transformers Trainer's checkpoint-N folder (with trainer_state.json); a triax run "
                          "continues by itself (same trainer.run_dir), and other checkpoints start a run with "
                          "model.init_from")
    return run


def continuation_overrides(config: TrainConfig, run: ForeignRun | None = None) -> tuple[list[str], list[str]]:
    """(the `key=value` overrides that continue trainer.continue_from's run as the tool that began
    it would, notes on what could not be carried over). `run`: that run, if it is open already."""
    if run is None:
        run = _open_continued(config)
    parallel = config.parallel
    # Whichever launcher started this process (torchrun, srun, mpirun) says how many there are.
    data_parallel = max(1, detect_place().world_size // max(1, parallel.tp * parallel.pp))
    return run.overrides(data_parallel)


def _compose(overrides: list[str]) -> TrainConfig:
    for override in overrides:
        match = re.fullmatch(r"\+?\+?~?model=(.*)", override)
        if match and match.group(1) not in _model_presets():
            raise ConfigError(f"unknown model preset {match.group(1)!r}; presets are: "
                              f"{', '.join(_model_presets())}")
    check_overrides(overrides, TrainConfig)
    # Hydra and OmegaConf take a large share of a command's first second: a misspelt key is
    # answered above without them, and `--help` never composes.
    from hydra import compose, initialize_config_module  # deferred: start-up time
    from hydra.core.global_hydra import GlobalHydra  # deferred: start-up time
    from hydra.errors import HydraException  # deferred: start-up time
    from omegaconf import OmegaConf  # deferred: start-up time
    from omegaconf.errors import OmegaConfBaseException  # deferred: start-up time

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="triax.conf", version_base=None):
            composed = compose(config_name="config", overrides=overrides)
        check_composed(composed, TrainConfig)
        config = OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_one_line(error)) from None
    except yaml.YAMLError as error:  # a config file with a Python tag or broken YAML: never run, one line
        raise ConfigError(f"a config file is not plain YAML ({_one_line(error)}); triax reads only plain "
                          "mappings, lists and scalars (no !!python or other tags)") from None
    finally:
        GlobalHydra.instance().clear()
    validate(config)
    return config


def _one_line(error: Exception) -> str:
    """Hydra wraps OmegaConf's precise message ("Key 'foo' not in 'TrainerConfig'", "Value 'abc'
    could not be converted to Integer") in vaguer ones; report the innermost one with its key."""
    chain = [error]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    keyed = [item for item in chain if "full_key:" in str(item)]
    cause = keyed[-1] if keyed else chain[min(1, len(chain) - 1)]
    text = str(cause).strip() or type(cause).__name__
    first = text.splitlines()[0]
    key = re.search(r"full_key: (\S+)", text)
    if key and re.match(r"Key '.*' not in", first):
        return str(unknown_key_error(key.group(1), sorted(schema_keys(TrainConfig))))
    if key:
        wrong_type = _wrong_type(key.group(1), first)
        if wrong_type:
            return wrong_type
    if key:
        first = f"{key.group(1)}: {first}"
    options = re.search(r"Available options in '[^']*':\n((?:\t\S+\n?)+)", text)
    if options:
        first += "; available: " + ", ".join(options.group(1).split())
    if "Could not override" in first:
        first += "; run `triax train --help` to list the valid keys"
    return f"config error: {first}"


# OmegaConf's name for a type it could not convert to -> how the error names what is expected.
_EXPECTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "text"}


def _wrong_type(key: str, message: str) -> str | None:
    """One line for a value of the wrong type: the key, the value, the type expected and the
    default as an example (OmegaConf's own wording names neither the expectation nor an example)."""
    section, _, name = key.partition(".")
    schema = typing.get_type_hints(TrainConfig).get(section)
    item = next((item for item in dataclasses.fields(schema) if item.name == name), None) if schema else None
    if item is None:
        return None
    hint = typing.get_type_hints(schema)[name]
    default = _format_value(_default(item))
    converted = (re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", message)
                 or re.match(r"Value '(.*)' is not a valid (bool)", message))
    expected = _EXPECTED.get(converted.group(2).capitalize().replace("Bool", "Boolean")) if converted else None
    if expected:
        optional = " or null" if typing.get_origin(hint) is typing.Union else ""
        return f"{key}={converted.group(1)} is not {expected}; give {expected}{optional} (default {default})"
    if "is not a ListConfig" in message:
        return f"{key} is a list; write it in brackets (default {key}={default})"
    return None


def absolute_paths(config: TrainConfig) -> None:
    """Make the local paths a run depends on absolute, in place, as the directory it starts in
    resolves them: the run's config.yaml then names its data, its starting checkpoint and its
    snapshots wherever `triax eval`, `generate` or a resume is run from. URLs (s3://...) stay;
    trainer.run_dir stays as given (each command names the run directory anew)."""
    def absolute(path: str | None) -> str | None:
        if not path or "://" in path:
            return path
        return os.path.abspath(os.path.expanduser(path))

    config.data.path = absolute(config.data.path)
    config.data.val_path = absolute(config.data.val_path)
    for source in config.data.sources:
        source.path, source.val_path = absolute(source.path), absolute(source.val_path)
    config.model.init_from = absolute(config.model.init_from)
    config.trainer.continue_from = absolute(config.trainer.continue_from)
    config.trainer.snapshot_dir = absolute(config.trainer.snapshot_dir)


def to_dict(config: TrainConfig) -> dict:
    from omegaconf import OmegaConf  # deferred: start-up time (see _compose)

    return OmegaConf.to_container(OmegaConf.structured(config))


def from_dict(values: dict) -> TrainConfig:
    from omegaconf import OmegaConf  # deferred: start-up time (see _compose)

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), values))


def _default(item: dataclasses.Field) -> object:
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return None


def _format_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(_format_value, value)) + "]"
    return str(value).replace(" ", "")


def describe_keys(width: int = 100) -> str:
    """Every key of TrainConfig with its default and docstring, section by section, for
    `triax train --help`; generated from the dataclasses themselves."""
    lines = []
    for section in dataclasses.fields(TrainConfig):
        schema = section.type if isinstance(section.type, type) else _default(section).__class__
        title = " ".join((inspect.getdoc(schema) or "").split())
        if title.startswith(f"{schema.__name__}("):  # dataclass's generated signature, not a docstring
            title = ""
        lines += textwrap.wrap(f"{section.name}: {title}", width=width, subsequent_indent="  ") or [section.name]
        docs = field_docs(schema)
        for item in dataclasses.fields(schema):
            key = f"  {section.name}.{item.name}={_format_value(_default(item))}"
            doc = textwrap.wrap(docs.get(item.name, ""), width=max(40, width - 44)) or [""]
            lines.append(key.ljust(44) + (" " if len(key) >= 44 else "") + doc[0])
            lines += [" " * 44 + more for more in doc[1:]]
    return "\n".join(lines)
