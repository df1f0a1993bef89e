"""MkDocs hook: fills docs/configuration.md with every `triax train` key, its default and its
docstring, read from the config dataclasses (triax/config/schema.py) at build time, so the page
cannot drift from the schema. `triax train --help` prints the same keys from the same source."""

from __future__ import annotations

import dataclasses
import inspect
import typing

MARKER = "<!-- config-reference -->"


def _cell(text: str) -> str:
    """A table cell: Markdown's column separator escaped."""
    return text.replace("|", "\\|")


def config_reference() -> str:
    """One section per config group (model, data, ...), one table row per key."""
    from triax.config.compose import _default
    from triax.config import TrainConfig

    parts = []
    for section in dataclasses.fields(TrainConfig):
        schema = type(_default(section))
        title = " ".join((inspect.getdoc(schema) or "").split())
        parts += [f"## `{section.name}`", "", title, "", "| key | default | meaning |", "| --- | --- | --- |"]
        parts += _rows(section.name, schema)
        parts.append("")
    return "\n".join(parts)


def _rows(prefix: str, schema) -> list[str]:
    """A row per key of `schema`; a group of keys nested in it (model.lora) gives a row per key of its own."""
    from triax.config.compose import _default, _format_value
    from triax.config import field_docs

    rows, docs, hints = [], field_docs(schema), typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        default = _default(item)
        if dataclasses.is_dataclass(default):
            rows += _rows(f"{prefix}.{item.name}", type(default))
            continue
        listed = typing.get_args(hints[item.name])[0] if typing.get_origin(hints[item.name]) is list else None
        if dataclasses.is_dataclass(listed):  # a list of sections (data.sources): a row per key of an item
            item_rows = _rows(f"{prefix}.{item.name}", listed)
            item_rows[0] = item_rows[0][:-2] + f" Each item of `{prefix}.{item.name}` (default `[]`): " \
                f"{_cell(docs.get(item.name, ''))} |"
            rows += item_rows
            continue
        rows.append(f"| `{prefix}.{item.name}` | `{_cell(_format_value(default))}` | {_cell(docs.get(item.name, ''))} |")
    return rows


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "configuration.md":
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/configuration.md lost its {MARKER} line; put it back where the keys go")
    return markdown.replace(MARKER, config_reference())
