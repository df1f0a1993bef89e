"""The one way triax reads a YAML file a user hands it (`triax launch --config_file`, `triax
horovodrun --config-file`): bounded in bytes, in depth and in what its aliases expand to.

yaml.safe_load runs no code, but it trusts the document's shape:
- an alias bomb (`a: &a [x, x]`, `b: &b [*a, *a]`, ... ten levels in 400 bytes) loads as a small
  graph of shared lists, and the first repr, comparison or walk over it visits 2^n items: the
  process grinds for tens of seconds and ends in MemoryError;
- a document nested a few thousand levels deep (`[[[[...`) makes PyYAML's recursive composer
  raise RecursionError, a traceback;
- an alias to a collection still being built (`&a [*a]`) makes a cycle that no config needs.
So the composer here counts, as each node is made, the nodes and the depth the document has once
every alias is expanded, and stops at the first bound crossed (the work is linear in the file's
size: an alias adds its anchor's counts, it is not walked again). Mapping keys must be strings,
as every key of a configuration is a name. Every problem is one line naming the file.
"""

from __future__ import annotations

import os
from typing import IO

import yaml

from triax import safe_files
from triax.errors import TriaxError

# A launch configuration is a few dozen lines, a few levels deep.
MAX_CONFIG_BYTES = 2**20
MAX_NODES = 10_000  # scalars, lists and mappings, aliases expanded
MAX_DEPTH = 32


class YamlFileError(TriaxError, ValueError):
    """A YAML file that is unreadable, too large, too deep, expands too far, or is not YAML."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer keeps, per node, (nodes, depth) with aliases expanded."""

    max_nodes = MAX_NODES
    max_depth = MAX_DEPTH

    def __init__(self, stream: str | bytes | IO):
        super().__init__(stream)
        self._depth = 0
        self._expanded: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, depth), once finished

    def compose_node(self, parent: yaml.Node | None, index: object):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            if id(node) not in self._expanded:
                raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} refers to a collection "
                                                  "that contains it (a cycle)", event.start_mark)
            self._check(*self._expanded[id(node)], event.start_mark)
            return node
        self._depth += 1
        if self._depth > self.max_depth:
            raise yaml.composer.ComposerError(None, None, f"nested more than {self.max_depth} levels deep",
                                              self.peek_event().start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        counts = [self._expanded[id(child)] for child in children]
        nodes = 1 + sum(count for count, _ in counts)
        depth = 1 + max((deep for _, deep in counts), default=0)
        self._check(nodes, depth, node.start_mark)
        self._expanded[id(node)] = (nodes, depth)
        return node

    def _check(self, nodes: int, depth: int, mark: yaml.Mark | None) -> None:
        if nodes > self.max_nodes:
            raise yaml.composer.ComposerError(None, None, f"expands to more than {self.max_nodes} values "
                                              "(aliases counted each time they are used)", mark)
        if depth > self.max_depth:
            raise yaml.composer.ComposerError(None, None, f"nests more than {self.max_depth} levels deep "
                                              "(aliases expanded)", mark)


def _string_keys(value: object, where: str, source: str) -> None:
    """Every mapping key under `value` is a string. The composer bounded the walk's size."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise YamlFileError(f"{source}: key {key!r}{where} is not a name; write names as keys")
            _string_keys(item, f" under {key}" if not where else f"{where}.{key}", source)
    elif isinstance(value, list):
        for item in value:
            _string_keys(item, where, source)


def loads(text: str, source: str):
    """The document in `text` (None if empty), or YamlFileError naming `source`."""
    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise YamlFileError(f"{source} is not a YAML file triax reads: {problem}{where}") from None
    _string_keys(data, "", source)
    return data


def read(path: str, max_bytes: int = MAX_CONFIG_BYTES, source: str | None = None):
    """The YAML document at `path`: the user's own argument, so a link they name is followed
    (realpath), but the file must be a regular one (a FIFO is refused at once) of at most
    `max_bytes`, in UTF-8."""
    source = source or path
    try:
        text = safe_files.read_text(os.path.realpath(path), max_bytes)
    except UnicodeDecodeError as error:
        raise YamlFileError(f"{source} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    except safe_files.UnsafeFileError as error:
        raise YamlFileError(f"{source}: {error}") from None
    except OSError as error:
        raise YamlFileError(f"cannot read {source}: {error.strerror or error}") from None
    return loads(text, source)
