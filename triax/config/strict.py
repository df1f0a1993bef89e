"""Strict checks of `triax train`'s overrides and composed config, before anything runs.

Hydra's `+key=value` and `++key=value` add keys the schema does not have, and OmegaConf then drops
them silently: `+trainer.max_step=5` would train the default 500 steps. So every key, from the
command line or from a YAML file, must name a field of the dataclasses in triax/config/schema.py.

Interpolations (`${oc.env:HOME}`, `${now:...}`, `${trainer.seed}`) are refused in every value: a
value that changes with the environment would be stored resolved in the snapshot and differ on a
resume, and one that reads the environment is a way for a config file to pull in secrets. Write the
value itself (your shell can expand variables: `trainer.run_dir=$HOME/runs/a`).

`hydra.searchpath=[file://DIR]` is the one Hydra setting accepted: it lets `+experiment=NAME` find
DIR/experiment/NAME.yaml (checked like any other key). Other `hydra.*` keys would have no effect
(triax composes the config itself, it does not run a Hydra app), so they are refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing

from triax.errors import ConfigError

# Config groups chosen with `group=option` rather than keys of the schema.
CONFIG_GROUPS = ("model", "experiment")
ACCEPTED_HYDRA_KEYS = ("hydra.searchpath",)
# Other tools' names for triax's keys (transformers' TrainingArguments, nanoGPT), which no
# spelling distance finds: `optim.learning_rate` is `optim.lr`.
OTHER_NAMES = {"learning_rate": "lr", "max_iters": "max_steps", "num_train_epochs": "max_epochs",
               "per_device_train_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum",
               "warmup_iters": "warmup_steps", "output_dir": "run_dir", "out_dir": "run_dir"}


def schema_keys(schema: type) -> dict[str, object]:
    """Every dotted key of a dataclass schema -> its type hint (sections included)."""
    keys: dict[str, object] = {}
    for name, hint in typing.get_type_hints(schema).items():
        keys[name] = hint
        item = _list_item(hint)
        if dataclasses.is_dataclass(hint) or dataclasses.is_dataclass(item):  # a list's items: name.KEY
            keys.update({f"{name}.{inner}": inner_hint
                         for inner, inner_hint in schema_keys(item if item is not None else hint).items()})
    return keys


def _list_item(hint: object) -> object | None:
    """The item type of a List[...] hint, else None."""
    if typing.get_origin(hint) in (list, typing.List):
        return typing.get_args(hint)[0]
    return None


def closest_key(key: str, keys: list[str]) -> str | None:
    """The valid key a typo most likely meant: a similar spelling in the same section
    (`trainer.max_step` -> `trainer.max_steps`), else the same word in another section
    (`trainer.lr` -> `optim.lr`), else a similar whole key."""
    section, _, leaf = key.rpartition(".")
    named = [candidate for candidate in keys if candidate.rpartition(".")[2] == OTHER_NAMES.get(leaf)]
    if named:  # the same section's first
        return sorted(named, key=lambda candidate: candidate.rpartition(".")[0] != section)[0]
    siblings = {candidate.rpartition(".")[2]: candidate for candidate in keys
                if candidate.rpartition(".")[0] == section}
    matches = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.7)
    if matches:
        return siblings[matches[0]]
    same_leaf = [candidate for candidate in keys if candidate.rpartition(".")[2] == leaf and candidate != key]
    if same_leaf:
        return same_leaf[0]
    matches = difflib.get_close_matches(key, keys, n=1, cutoff=0.85)
    return matches[0] if matches else None


def unknown_key_error(key: str, keys: list[str]) -> ConfigError:
    guess = closest_key(key, keys)
    hint = f" (did you mean {guess}?)" if guess else ""
    return ConfigError(f"unknown key {key}{hint}; `triax train --help` lists every key")


def _is_list_index(schema: dict, key: str) -> bool:
    """`optim.betas.0=0.8` sets one item of a list field."""
    parent, _, last = key.rpartition(".")
    return last.isdigit() and typing.get_origin(schema.get(parent)) in (list, typing.List)


def quote_text_values(overrides: list[str]) -> list[str]:
    """Hydra's override grammar takes only ASCII in an unquoted value (`trainer.run_dir=rün_日本語`
    is a "token recognition error"), but a path is text: such a value is quoted for Hydra. Not a
    value that holds quotes, backslashes or Hydra's own syntax (a list, a dict, an interpolation):
    the user quotes those as Hydra documents."""
    quoted = []
    for override in overrides:
        key, equals, value = override.partition("=")
        if (equals and not value.isascii() and not any(ch in value for ch in "'\"\\")
                and not value.startswith(("[", "{")) and "${" not in value):
            override = f"{key}='{value}'"
        quoted.append(override)
    return quoted


def check_overrides(overrides: list[str], schema: type) -> None:
    """Refuse, one line each, an override whose key is not in the schema (with or without `+`),
    a deletion (`~key`), and Hydra settings other than hydra.searchpath."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    keys = schema_keys(schema)
    known = sorted(keys)
    parser = OverridesParser.create()
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException as error:
            raise ConfigError(f"cannot read the override {text!r}: {str(error).strip().splitlines()[0]}; "
                              "write key=value (e.g. trainer.max_steps=100)") from None
        key = override.key_or_group
        if override.package is not None:
            raise ConfigError(f"override {text!r} names a package (@...); triax configs have none: write key=value")
        if override.is_delete():
            raise ConfigError(f"override {text!r} deletes a key; every key of the schema must stay: "
                              "set it to another value (or null where the default is null) instead")
        if key.split(".")[0] == "hydra":
            if key not in ACCEPTED_HYDRA_KEYS:
                raise ConfigError(f"{key} has no effect in triax train (the only Hydra setting it takes is "
                                  "hydra.searchpath, to find your own +experiment files); use trainer.run_dir "
                                  "for where output goes")
            continue
        if key in CONFIG_GROUPS:
            value = override.value()
            if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", value) or ".." in value:
                raise ConfigError(f"{key}={value!r} is not a plain {key} name (no paths); "
                                  f"give a name such as {'gpt2' if key == 'model' else 'gpt2_train_cfg'}")
            continue
        if key not in keys and not _is_list_index(keys, key):
            raise unknown_key_error(key, known)
        _check_list_items(key, override.value(), keys, known)


def _check_list_items(key: str, value: object, keys: dict, known: list[str]) -> None:
    """A list of sections (data.sources=[{path: ..., weight: ...}]): each item's keys are the
    section's, named in full (OmegaConf would name only the last part)."""
    if not dataclasses.is_dataclass(_list_item(keys.get(key))) or not isinstance(value, list):
        return
    for item in value:
        for name in (item if isinstance(item, dict) else {}):
            if f"{key}.{name}" not in keys:
                raise unknown_key_error(f"{key}.{name}", known)


def check_composed(composed: object, schema: type) -> None:
    """Walk the composed config: every key must be in `schema`, no value may be an interpolation.
    Catches what YAML files (an experiment, a file on hydra.searchpath) bring in, too."""
    from omegaconf import OmegaConf

    keys = schema_keys(schema)
    known = sorted(keys)

    def walk(value: object, key: str) -> None:
        if isinstance(value, dict):
            free_form = typing.get_origin(keys.get(key)) in (dict, typing.Dict)  # a Dict field: any keys
            for name, inner in value.items():
                inner_key = f"{key}.{name}" if key else str(name)
                if inner_key not in keys and not free_form:
                    raise unknown_key_error(inner_key, known)
                walk(inner, inner_key)
        elif isinstance(value, list):
            items_are_sections = dataclasses.is_dataclass(_list_item(keys.get(key)))
            for index, inner in enumerate(value):
                walk(inner, key if items_are_sections else f"{key}.{index}")
        elif isinstance(value, str) and "${" in value:
            raise ConfigError(f"{key}={value}: interpolations (${{...}}) are not accepted in triax configs; "
                              "write the value itself (your shell can expand $VARIABLES)")

    walk(OmegaConf.to_container(composed, resolve=False), "")
