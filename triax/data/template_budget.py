"""Bounds on the work a chat template does and on the size of what it builds, checked as it builds
it: before an operation that could make something large (a repetition `'a' * n`, a power, a
padded or indented string, JSON with an indent), from the sizes of its inputs, and after every
operation, on its result. A template renders every record of a data set, and comes from whoever
published the checkpoint: one that would loop for hours or build gigabytes is refused when it
passes the bound, in bounded time and memory, not after.

Sizes are in characters (text) or items (lists, dicts): a value's size counts what `str()` of it
would print, so a list of a thousand references to one long text is as large as its printout.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, Callable, Iterable

import jinja2.nodes
from jinja2.visitor import NodeTransformer

# Calls, attribute reads, item reads, operators and loop iterations of one rendering. A real
# template spends tens per message; a million is seconds of Python and far past any conversation.
MAX_OPERATIONS = 1_000_000
# A macro call costs Jinja about as much as a hundred simple operations (its frame, arguments, caller).
MACRO_CALL_COST = 100
# The largest text, list or dict a template may build (one conversation's whole rendering is held
# to the same bound by chat_template.MAX_RENDERED_CHARS).
MAX_VALUE_SIZE = 16 * 2**20
# All that one rendering builds, added up: bounds its memory whatever it keeps.
MAX_BUILT_SIZE = 256 * 2**20
# The largest integer a template may compute (a power or product past it is refused before it is
# computed): far past any count or token id.
MAX_INT_BITS = 4096
# tojson's indent: a real template indents by a few spaces.
MAX_JSON_INDENT = 64

DIGITS = re.compile(r"\d+")


class TemplateLimit(Exception):
    """A template passed one of the bounds above; the message says which."""


class Budget:
    """The running count of one rendering's operations and built sizes."""

    def __init__(self):
        self.operations = 0
        self.built = 0
        self.sizes: dict[int, tuple[object, int]] = {}  # id -> (container, deep size): each measured once

    def operation(self, count: int = 1) -> None:
        self.operations += count
        if self.operations > MAX_OPERATIONS:
            raise TemplateLimit(f"does more than {MAX_OPERATIONS} operations on one conversation")

    def built_value(self, value: Any):
        """Check and count a value an operation made; returns it."""
        size = self.size(value)
        check_size(size)
        self.add_built(size if isinstance(value, (str, bytes)) else min(size, _shallow(value)))
        return value

    def add_built(self, size: int) -> None:
        self.built += size
        if self.built > MAX_BUILT_SIZE:
            raise TemplateLimit(f"builds more than {MAX_BUILT_SIZE} characters in all for one conversation")

    def size(self, value: Any) -> int:
        return deep_size(value, self.sizes)


# What the sandbox hands the filters: the running rendering's Budget, or None (compile time).
BudgetOf = Callable[[], "Budget | None"]


def _shallow(value: Any) -> int:
    try:
        return len(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else 0
    except TypeError:
        return 0


def deep_size(value: Any, cache: dict | None = None, limit: int = MAX_VALUE_SIZE) -> int:
    """About what `str(value)` prints, in characters; stops counting past `limit`."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        return 8
    if cache is not None and id(value) in cache:
        return cache[id(value)][1]
    items = value.items() if isinstance(value, dict) else ((item, None) for item in value)
    total = 2
    for key, item in items:
        total += deep_size(key, cache, limit) + deep_size(item, cache, limit) + 2
        if total > limit:
            break
    if cache is not None:
        cache[id(value)] = (value, total)  # the value is held, so its id is not reused meanwhile
    return total


def check_size(size: int) -> None:
    if size > MAX_VALUE_SIZE:
        raise TemplateLimit(f"builds a value of more than {MAX_VALUE_SIZE} characters")


def check_int(value: int) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"computes an integer of more than {MAX_INT_BITS} bits")


def check_count(value: Any) -> None:
    """An integer argument (a width, a repetition, a count) that would make a value past the bound."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_VALUE_SIZE:
        raise TemplateLimit(f"asks for a width or count of {value}, more than {MAX_VALUE_SIZE}")


def check_widths(text: str) -> None:
    """A %-format or str.format text whose widths (`%0999999999d`, `{:>999999999}`) pass the bound."""
    for run in DIGITS.findall(text):
        if len(run) > 9 or int(run) > MAX_VALUE_SIZE:
            raise TemplateLimit(f"formats with a width of {run[:20]}, more than {MAX_VALUE_SIZE}")


def binop_before(operator: str, left: Any, right: Any, size: Callable) -> None:
    """Refuse an operator whose result would pass a bound, from its inputs' sizes."""
    numbers = all(isinstance(side, (int, float)) and not isinstance(side, bool) for side in (left, right))
    if operator == "**" and numbers and isinstance(left, int) and isinstance(right, int):
        if abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > MAX_INT_BITS:
            raise TemplateLimit(f"computes {left} ** {right}, an integer of more than {MAX_INT_BITS} bits")
    elif operator == "*" and numbers:
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"computes an integer of more than {MAX_INT_BITS} bits")
    elif operator == "*":
        count, sequence = (right, left) if isinstance(right, int) else (left, right)
        if isinstance(count, int) and count > 0 and size(sequence) * count > MAX_VALUE_SIZE:
            raise TemplateLimit(f"repeats a value of {size(sequence)} characters {count} times, more than "
                                f"{MAX_VALUE_SIZE}")
    elif operator == "+" and not numbers:
        if size(left) + size(right) > MAX_VALUE_SIZE:
            raise TemplateLimit(f"builds a value of more than {MAX_VALUE_SIZE} characters")
    elif operator == "%" and isinstance(left, str):
        check_widths(left)
        check_size(len(left) + size(right))


# str methods a template may call: their result is no larger than their inputs ...
STR_METHODS_PLAIN = {
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "upper", "lower",
    "title", "capitalize", "casefold", "swapcase", "find", "rfind", "index", "rindex", "count", "partition",
    "rpartition", "removeprefix", "removesuffix", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
    "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper", "encode",
}
# ... or bounded from them before the call (below). Others (translate, expandtabs, format_map, ...)
# are not offered: no chat template needs them.
STR_METHODS_SIZED = {"replace", "join", "ljust", "rjust", "center", "zfill", "format"}


def str_attribute(obj: Any, name: str) -> None:
    """A str method read from a template: only those offered; format's widths checked on reading
    (Jinja's sandbox hands templates a wrapped str.format)."""
    if not (isinstance(obj, str) and isinstance(name, str) and callable(getattr(str, name, None))):
        return
    if name not in STR_METHODS_PLAIN and name not in STR_METHODS_SIZED:
        raise TemplateLimit(f"calls str.{name}, which chat templates are not offered")
    if name == "format":
        check_widths(obj)


def str_method_before(text: str, name: str, args: tuple, kwargs: dict, size: Callable) -> None:
    if name in STR_METHODS_PLAIN:
        return
    if name not in STR_METHODS_SIZED:
        raise TemplateLimit(f"calls str.{name}, which chat templates are not offered")
    if name in ("ljust", "rjust", "center", "zfill") and args:
        check_count(args[0])
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            check_size(len(text) + (len(text) // max(len(old), 1) + 1) * len(new))
    elif name == "join" and args:
        items = args[0]
        count = len(items) if hasattr(items, "__len__") else 0
        check_size(len(text) * count + size(items))
    elif name == "format":
        check_widths(text)
        for value in list(args) + list(kwargs.values()):
            check_count(value)


def filter_before(name: str, args: tuple, kwargs: dict, size: Callable) -> None:
    """The bounds of Jinja's filters that can build something larger than their inputs."""
    values = list(args) + list(kwargs.values())
    for value in values:
        check_count(value)
    subject = args[0] if args else None
    if name == "indent" and isinstance(subject, str):
        width = kwargs.get("width", args[1] if len(args) > 1 else 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        check_size(len(subject) + (subject.count("\n") + 1) * width)
    elif name == "replace" and isinstance(subject, str) and len(args) >= 3:
        str_method_before(subject, "replace", args[1:3], {}, size)
    elif name == "join" and subject is not None:
        separator = kwargs.get("d", args[1] if len(args) > 1 else "")
        count = len(subject) if hasattr(subject, "__len__") else 0
        check_size(size(subject) + (len(separator) if isinstance(separator, str) else 0) * count)
    elif name == "format" and isinstance(subject, str):
        check_widths(subject)


def tojson(budget_of: "BudgetOf", value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """json.dumps as transformers gives templates (no HTML escaping), encoded piece by piece so that
    a value that would print past the bound is stopped at the bound, not after."""
    if isinstance(indent, bool) or not (indent is None or (isinstance(indent, int) and 0 <= indent <= MAX_JSON_INDENT)
                                        or (isinstance(indent, str) and len(indent) <= MAX_JSON_INDENT)):
        raise TemplateLimit(f"asks tojson for an indent of {str(indent)[:20]}; at most {MAX_JSON_INDENT}")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, length = [], 0
    budget = budget_of()
    for piece in encoder.iterencode(value):
        pieces.append(piece)
        length += len(piece)
        check_size(length)
        if budget is not None:
            budget.operation()
    return "".join(pieces)


def _weight(body: list) -> int:
    """The nodes of a loop's or macro's body: what one pass of it costs at least."""
    return 1 + sum(1 + sum(1 for _ in node.find_all(jinja2.nodes.Node)) for node in body)


class Counted(NodeTransformer):
    """Rewrites a parsed template so that every loop's iterable passes through the `triax_loop`
    filter (each iteration counted as its body's size in operations), every macro's body charges
    its size when it runs (`triax_charge`), and every `~` concatenation passes through
    `triax_concat` (its size checked before it is joined)."""

    def visit_For(self, node: jinja2.nodes.Node):
        node = self.generic_visit(node)
        weight = jinja2.nodes.Const(_weight(node.body), lineno=node.lineno)
        node.iter = jinja2.nodes.Filter(node.iter, "triax_loop", [weight], [], None, None, lineno=node.lineno)
        return node

    def _charged(self, node: jinja2.nodes.Node):
        node = self.generic_visit(node)
        weight = jinja2.nodes.Const(_weight(node.body), lineno=node.lineno)
        charge = jinja2.nodes.Filter(jinja2.nodes.Const(""), "triax_charge", [weight], [], None, None,
                                     lineno=node.lineno)
        node.body.insert(0, jinja2.nodes.Output([charge], lineno=node.lineno))
        return node

    visit_Macro = visit_CallBlock = visit_FilterBlock = _charged

    def visit_Concat(self, node: jinja2.nodes.Node):
        node = self.generic_visit(node)
        return jinja2.nodes.Filter(jinja2.nodes.List(node.nodes, lineno=node.lineno), "triax_concat", [], [],
                                   None, None, lineno=node.lineno)


def counted_loop(budget_of: "BudgetOf", iterable: Iterable, weight: int = 1):
    budget = budget_of()
    for item in iterable:
        if budget is not None:
            budget.operation(weight)
        yield item


def charge(budget_of: "BudgetOf", empty: str, weight: int) -> str:
    budget = budget_of()
    if budget is not None:
        budget.operation(weight)
    return empty


def checked_join(budget_of: "BudgetOf", pieces: Iterable) -> str:
    """Jinja's concat of a buffered body (a macro's, a block's output): sizes checked before joining."""
    pieces = pieces if isinstance(pieces, list) else list(pieces)
    budget = budget_of()
    length = 0
    for piece in pieces:
        length += len(piece)
        check_size(length)
    if budget is not None:
        budget.operation(len(pieces))
        budget.add_built(length)
    return "".join(pieces)


def concat(budget_of: "BudgetOf", parts: list) -> str:
    budget = budget_of()
    size = budget.size if budget is not None else deep_size
    check_size(sum(size(part) for part in parts))
    return "".join(map(str, parts))


def guarded_filter(function: Callable, name: str, budget_of: "BudgetOf"):
    """Jinja filter `function` with its bounds checked before it runs and its result after."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any):
        budget = budget_of()
        values = args[1:] if getattr(function, "jinja_pass_arg", None) is not None else args
        filter_before(name, tuple(values), kwargs, budget.size if budget is not None else deep_size)
        if budget is None:
            return function(*args, **kwargs)
        budget.operation()
        return budget.built_value(function(*args, **kwargs))

    return guarded
