"""Chat templates: the Jinja program a checkpoint ships (tokenizer_config.json's `chat_template`,
or chat_template.jinja beside it) that turns a conversation into the text the model was tuned on.

A template comes from whoever published the checkpoint, so it is untrusted code. It runs the way
transformers runs it, in Jinja's ImmutableSandboxedEnvironment: no attribute starting with an
underscore (the `cycler.__init__.__globals__` escapes), no mutation of the data passed in, no
loader (so `{% import %}`, `{% include %}` and `{% extends %}` cannot read any file), and only the
helpers transformers gives templates (raise_exception, tojson, namespace, strftime_now is left
out: a training example must not depend on the clock). Two limits transformers lacks, because a
template here renders every record of a data set: the template's own size, and the size of what
it renders (checked while it renders, so a loop that would print gigabytes stops at the cap).

`{% generation %}...{% endgeneration %}` marks the text the model is to learn to write (the
assistant's turns): `render` returns those character spans, which become the loss mask exactly as
transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` makes it.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from triax.data import template_budget as budgets
from triax.data.errors import DataError
from triax.errors import printable

# The largest known templates are a few tens of kilobytes; one larger is not a chat template.
MAX_TEMPLATE_CHARS = 256 * 1024
# What one conversation may render to: far past any context window triax trains, small enough that
# a hostile loop is stopped long before it exhausts memory.
MAX_RENDERED_CHARS = 16 * 2**20

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Named templates for a checkpoint that ships none (data.chat_template=NAME). ChatML is what Qwen2
# and many fine-tunes use; the generation tags mark each assistant turn and its end marker.
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{{ '\\n' }}"
        "{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
}


class TemplateError(DataError):
    """A chat template that does not compile, escapes its sandbox, or fails on a conversation."""


class TemplateBoundError(TemplateError):
    """A template that passed a bound on its work or on what it builds (template_budget.py)."""


class _RenderTooLarge(Exception):
    pass


class GenerationSpans(jinja2.ext.Extension):
    """`{% generation %}` blocks: their text is rendered as usual and its character span in
    the whole output recorded (the output so far is what `render` has collected)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser):
        lineno = next(parser.stream).lineno
        if getattr(self, "depth", 0):
            # The answer spans would overlap: which text is the answer is ambiguous.
            parser.fail("a {% generation %} block inside another one; close the first before opening the next",
                        lineno)
        self.depth = 1
        try:
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        finally:
            self.depth = 0
        return jinja2.nodes.CallBlock(self.call_method("_span", []), [], [], body).set_lineno(lineno)

    def _span(self, caller: Callable[[], str]):
        state = self.environment.render_state
        if state is not None and state.in_generation:  # a macro with one, called inside another
            raise jinja2.exceptions.TemplateError("a {% generation %} block runs inside another one")
        if state is not None:
            state.in_generation = True
        try:
            text = caller()
        finally:
            if state is not None:
                state.in_generation = False
        if state is not None:
            start = state.length()
            state.spans.append((start, start + len(text)))
        return text

class Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names (transformers' rule: no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any):
        Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: str):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)

class Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, stricter: forbidden attributes refuse the template, and every
    operation is counted and its inputs and result checked against template_budget's bounds."""

    # Intercepted so that their inputs are checked before a result past the bounds is computed
    # (and never folded into a constant at compile time).
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def budget(self) -> budgets.Budget | None:
        return self.render_state.budget if self.render_state is not None else None

    def _sized(self):
        budget = self.budget()
        return budget.size if budget is not None else budgets.deep_size

    def _counted(self, value: Any):
        budget = self.budget()
        if budget is None:
            return value
        budget.operation()
        return budget.built_value(value)

    def _parse(self, source: str, name: str | None, filename: str | None):
        return budgets.Counted().visit(super()._parse(source, name, filename))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any):
        budgets.binop_before(operator, left, right, self._sized())
        result = super().call_binop(context, operator, left, right)
        budgets.check_int(result)
        return self._counted(result)

    def call(__self: Sandbox, __context: jinja2.runtime.Context, __obj: Any,  # noqa: N805 (Jinja's own signature)
             *args: Any, **kwargs: Any):
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and callable(__obj):
            budgets.str_method_before(owner, getattr(__obj, "__name__", ""), args, kwargs, __self._sized())
        else:
            for value in list(args) + list(kwargs.values()):
                budgets.check_count(value)
        budget = __self.budget()
        if budget is not None and isinstance(__obj, (jinja2.runtime.Macro, jinja2.runtime.LoopContext)):
            budget.operation(budgets.MACRO_CALL_COST)
        if isinstance(__obj, jinja2.runtime.LoopContext) and args:
            # loop(children) of a recursive loop: its iterations counted like the first level's
            args = (budgets.counted_loop(__self.budget, args[0], budgets.MACRO_CALL_COST), *args[1:])
        return __self._counted(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str):
        budgets.str_attribute(obj, attribute)
        return self._counted(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any):
        budgets.str_attribute(obj, argument)
        return self._counted(super().getitem(obj, argument))

    def unsafe_undefined(self, obj: Any, attribute: str):
        # Jinja's sandbox answers a forbidden attribute with an undefined value, which prints as
        # nothing: `{{ lipsum.__globals__ }}` would render silently. No legitimate template
        # asks for one, so the attempt itself refuses the template.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

# trim_blocks and lstrip_blocks as transformers sets them: the same template gives the same text.


def _environment():
    environment = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, jinja2.ext.loopcontrols])
    environment.render_state = None
    budget_of = environment.budget
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON (as transformers gives).
    environment.filters["tojson"] = functools.partial(budgets.tojson, budget_of)
    for name, function in list(environment.filters.items()):
        environment.filters[name] = budgets.guarded_filter(function, name, budget_of)
    environment.filters["triax_loop"] = functools.partial(budgets.counted_loop, budget_of)
    environment.filters["triax_concat"] = functools.partial(budgets.concat, budget_of)
    environment.filters["triax_charge"] = functools.partial(budgets.charge, budget_of)
    environment.concat = functools.partial(budgets.checked_join, budget_of)
    del environment.globals["lipsum"]  # lorem ipsum of any length: no chat template needs it
    environment.globals["raise_exception"] = raise_exception
    environment.globals["namespace"] = Namespace
    environment.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    return environment


class _RenderState:
    def __init__(self):
        self.blocks: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self.chars = 0
        self.in_generation = False
        self.budget = budgets.Budget()

    def length(self) -> int:
        return self.chars


class ChatTemplate:
    """A compiled, sandboxed chat template. `special_tokens`: the names templates read besides the
    conversation (bos_token, eos_token, ...), from tokenizer_config.json as transformers passes them."""

    def __init__(self, source: str, origin: str, special_tokens: dict[str, str] | None = None):
        self.origin = origin
        if not isinstance(source, str) or not source.strip():
            raise TemplateError(f"the chat template of {origin} is empty or not text; give a checkpoint with a "
                                "chat_template or name a built-in one (data.chat_template=chatml)")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"the chat template of {origin} is {len(source)} characters, more than the "
                                f"{MAX_TEMPLATE_CHARS} a chat template can be; it is not one")
        self.source = source
        self.has_generation_tags = bool(GENERATION_TAG.search(source))
        self.special_tokens = dict(special_tokens or {})
        self.environment = _environment()
        try:
            self.template = self.environment.from_string(source)
        except jinja2.exceptions.TemplateError as error:
            raise TemplateError(f"the chat template of {origin} does not compile: {_first_line(error)}") from None
        except RecursionError:
            raise TemplateError(f"the chat template of {origin} nests too deeply to compile") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its `{% generation %}` blocks."""
        state = _RenderState()
        self.environment.render_state = state
        try:
            for block in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                tools=None, documents=None, **self.special_tokens):
                state.blocks.append(block)
                state.chars += len(block)
                if state.chars > MAX_RENDERED_CHARS:
                    raise _RenderTooLarge()
        except _RenderTooLarge:
            raise TemplateBoundError(f"the chat template of {self.origin} renders one conversation to more than "
                                f"{MAX_RENDERED_CHARS} characters; it is not a chat template") from None
        except budgets.TemplateLimit as error:
            raise TemplateBoundError(f"the chat template of {self.origin} {error} (a bound on what a template may do "
                                     f"for one conversation; this one has {len(messages)} messages): a template that "
                                     "does that is not one triax renders, and a conversation that needs it is too "
                                     "long to train on") from None
        except jinja2.exceptions.SecurityError as error:
            raise TemplateError(f"the chat template of {self.origin} tried something its sandbox forbids "
                                f"({_first_line(error)}); use a template without it") from None
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
                ZeroDivisionError, OverflowError) as error:
            # TypeError: `{% import %}` / `{% include %}` with no loader (nothing to read files with).
            raise TemplateError(f"the chat template of {self.origin} fails on a conversation "
                                f"({type(error).__name__}: {_first_line(error)})") from None
        except (RecursionError, MemoryError):
            raise TemplateError(f"the chat template of {self.origin} recursed or allocated without bound "
                                "rendering a conversation") from None
        finally:
            self.environment.render_state = None
        return "".join(state.blocks), state.spans


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return printable(text[0][:300]) if text else type(error).__name__


def special_tokens_of(tokenizer_config: dict) -> dict[str, str]:
    """{bos_token: text, ...} of tokenizer_config.json, whose entries are text or transformers'
    AddedToken dicts ({"content": ...})."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    found = {}
    for name in names:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def template_of_config(tokenizer_config: dict, origin: str) -> str | None:
    """tokenizer_config.json's chat_template: text, or transformers' list of {name, template} of
    which "default" is the one a plain apply_chat_template uses."""
    value = tokenizer_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
    raise TemplateError(f"{origin}: chat_template must be text or a list of {{name, template}} with a 'default' "
                        f"one, got {type(value).__name__}")
