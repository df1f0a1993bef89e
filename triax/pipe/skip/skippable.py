"""Skip connections in an `nn.Sequential`: a layer stashes a tensor, a later layer pops it.

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, input):
            yield stash("skip", input)          # hand `input` to whichever layer pops "skip"
            return self.conv(input)

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, input):
            skip = yield pop("skip")            # the tensor Down stashed
            return self.conv(input) + skip

Every name is declared up front, so a `Pipe` can check the pairs (`verify_skippables`) and plan
which tensors cross partitions before anything runs. The layers work the same without a Pipe.
`skippable(...)` returns a new class, a `Skippable`, whose instances build the decorated class
with the same arguments and keep it as `.module`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, TYPE_CHECKING

from torch import nn

from triax.pipe.errors import PipeRuntimeError, PipeTypeError
from triax.pipe.skip.namespace import Namespace
from triax.pipe.skip.tracker import current_skip_tracker

if TYPE_CHECKING:
    import torch

__all__ = ["skippable", "stash", "pop", "verify_skippables"]

_HOW_TO_PAIR = ("each skip name needs one layer that stashes it and one later layer that pops it; "
                "give repeated names their own Namespace with .isolate(Namespace())")


class stash:
    """`yield stash(name, tensor)` in a skippable forward: hand `tensor` (or None) to the layer popping `name`."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor | None):
        self.name = name
        self.tensor = tensor


class pop:
    """`tensor = yield pop(name)` in a skippable forward: the tensor stashed under `name`."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class Skippable(nn.Module):
    """A layer with declared skip names; made by `@skippable`, not directly."""

    module_cls: type
    stashable_names: frozenset = frozenset()
    poppable_names: frozenset = frozenset()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> tuple:
        """(namespace, name): how the pipe knows this skip."""
        return self.namespaces.get(name), name

    def stashable(self):
        """(namespace, name) of each name this layer stashes, in name order."""
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self):
        """(namespace, name) of each name this layer pops, in name order."""
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None):
        """Put this layer's skip names (all, or those in `only`) in namespace `ns`; returns the layer."""
        names = self.stashable_names | self.poppable_names if only is None else set(only)
        for name in names:
            self.namespaces[name] = ns
        return self

    def dispatch(self, input: Any, handle_stash: Callable[[str, torch.Tensor | None], None],
                 handle_pop: Callable[[str], torch.Tensor | None]):
        """Run the decorated module's forward, answering the stash and pop commands it yields."""
        result = self.module(input)
        if not inspect.isgenerator(result):  # a forward without yield: its return value is the output
            return result
        try:
            command = next(result)
            while True:
                if isinstance(command, stash):
                    handle_stash(command.name, command.tensor)
                    command = next(result)
                elif isinstance(command, pop):
                    command = result.send(handle_pop(command.name))
                else:
                    raise PipeTypeError(f"{command!r} is not a command from @skippable: a skippable forward "
                                        "may only yield stash(name, tensor) or pop(name)")
        except StopIteration as finished:
            return finished.value

    def forward(self, input: Any):
        tracker = current_skip_tracker()
        # The tensors to pop are taken before the layer runs, so that inside a Pipe their portals
        # fork from this layer's input (see tracker.py).
        poppable = {}
        for ns, name in self.poppable():
            try:
                input, poppable[name] = tracker.load(input, ns, name)
            except KeyError:
                raise PipeRuntimeError(f"'{name}' has not been stashed: {type(self.module).__name__} pops it but no "
                                       f"earlier layer stashed it in this forward pass; {_HOW_TO_PAIR}") from None
        stashed = {}

        def handle_stash(name: str, tensor: torch.Tensor | None) -> None:
            if name not in self.stashable_names:
                raise PipeRuntimeError(f"'{name}' has not been declared as stashable: add it to "
                                       f"@skippable(stash=[...]) of {type(self.module).__name__}")
            stashed[name] = tensor

        def handle_pop(name: str):
            if name not in self.poppable_names:
                raise PipeRuntimeError(f"'{name}' has not been declared as poppable: add it to "
                                       f"@skippable(pop=[...]) of {type(self.module).__name__}")
            if name not in poppable:
                raise PipeRuntimeError(f"'{name}' was popped twice by {type(self.module).__name__}; pop each "
                                       "name once per forward pass")
            return poppable.pop(name)

        output = self.dispatch(input, handle_stash, handle_pop)

        unused = [f"'{name}' must be stashed" for name in sorted(self.stashable_names - stashed.keys())]
        unused += [f"'{name}' must be popped" for name in sorted(poppable)]
        if unused:
            raise PipeRuntimeError(f"{', '.join(unused)} but have not: {type(self.module).__name__} declared them in "
                                   "@skippable(...); yield each declared stash and pop once per forward pass")
        for ns, name in self.stashable():
            output = tracker.save(output, ns, name, stashed[name])
        return output


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()):
    """Class decorator declaring the skip names an `nn.Module` stashes and pops (see the module docstring)."""
    stashable_names, poppable_names = frozenset(stash), frozenset(pop)

    def make_skippable(module_cls: type) -> type:
        # The new class takes the decorated one's name, module and docstring: it stands in for it.
        return type(module_cls.__name__, (Skippable,), {
            "module_cls": module_cls, "stashable_names": stashable_names, "poppable_names": poppable_names,
            "__module__": module_cls.__module__, "__qualname__": module_cls.__qualname__, "__doc__": module_cls.__doc__,
        })

    return make_skippable


def verify_skippables(module: nn.Sequential) -> None:
    """Check that the skippable layers among `module`'s children stash and pop in matching pairs.

    Raises TypeError naming every mismatch: a name stashed and popped by one layer, stashed twice or
    popped twice in one namespace, popped before (or without) being stashed, stashed but never popped.
    """
    stashed: set = set()
    popped: set = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        both = layer.stashable_names & layer.poppable_names
        for name in sorted(both):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for key in layer.stashable():
            if key[1] in both:
                continue
            if key in stashed:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as stashable but not isolated by namespace")
            else:
                stashed.add(key)
        for key in layer.poppable():
            if key[1] in both:
                continue
            if key in popped:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as poppable but not isolated by namespace")
            elif key not in stashed:
                problems.append(f"'{layer_name}' declared '{key[1]}' as poppable but it was not stashed")
            else:
                popped.add(key)
    for _, name in sorted(stashed - popped, key=lambda key: key[1]):
        problems.append(f"no module declared '{name}' as poppable but stashed")
    if problems:
        raise PipeTypeError(f"one or more pairs of stash and pop do not match: {'; '.join(problems)}; {_HOW_TO_PAIR}")
