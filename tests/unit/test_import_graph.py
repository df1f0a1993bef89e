"""triax's import graph: no module imports itself back, directly or through others, and an import
inside a function says why it is there.

An import circle works only as long as every module in it happens to be imported in one order;
hidden inside a function it still ties the modules together. Both kinds of import count here.
A package's `__init__` is the package's own node: `from triax.checkpoint import x` is an edge to
`triax.checkpoint` (its __init__ runs), `from triax.checkpoint.rng import x` an edge to
`triax.checkpoint.rng` only (its package is then already imported or importing). A package's
lazy attributes (the imports inside its `__init__`'s module-level `__getattr__`, PEP 562) run
only when the attribute is asked for and are not edges. Imports under `if TYPE_CHECKING:` never
run, but a module that needs another's types to be written still depends on it: a second rule
counts them too, so types two modules share live in a small leaf module both import.

The rule for imports inside functions (docs/architecture.md): the line, or the line above it,
carries a comment `# deferred: <reason>`, e.g. an optional dependency or start-up time.
"""

from __future__ import annotations

import ast
import os
from collections import Counter
from support import REPO_DIR

ROOT = REPO_DIR
PACKAGE = os.path.join(ROOT, "triax")
REASON = "deferred:"

# Imports inside functions written before the rule, per file, that do not state a reason yet.
# A file may only go down from here (state the reason, or move the import to the top).
UNEXPLAINED_BEFORE_THE_RULE: dict[str, int] = {
    "triax/accelerate/data_loader.py": 1,
    "triax/accelerate/utils/dataclasses.py": 1, "triax/accelerate/_internal/errors.py": 1,
    "triax/accelerate/launchers.py": 2, "triax/accelerate/state.py": 1, "triax/accelerate/utils/__init__.py": 5,
    "triax/arguments.py": 4,
    "triax/bench/adapters/hf_accelerate.py": 1, "triax/bench/adapters/plain_ddp.py": 1,
    "triax/bench/adapters/triax_accelerator.py": 2, "triax/bench/adapters/triax_horovod.py": 1,
    "triax/bench/adapters/triax_trainer.py": 4, "triax/bench/models.py": 2,
    "triax/bench/report.py": 2, "triax/checkpoint/rng.py": 1,
    "triax/checkpoint/snapshot.py": 3, "triax/commands/cli.py": 1, "triax/data/text.py": 1,
    "triax/data/tokenize_files.py": 8, "triax/data/tokenizer.py": 2, "triax/data/tokens.py": 2,
    "triax/horovod/basics.py": 3, "triax/horovod/elastic/commits.py": 3, "triax/horovod/handles.py": 1,
    "triax/horovod/process_sets.py": 2, "triax/launch/config.py": 2,
    "triax/launch/env.py": 5, "triax/launch/launcher.py": 5, "triax/tracking/throughput.py": 3, "triax/models/init.py": 2,
    "triax/parallel/comm_hooks.py": 1, "triax/parallel/grad_clip.py": 2, "triax/parallel/mesh.py": 1,
    "triax/parallel/parallelize.py": 5, "triax/parallel/plan.py": 3, "triax/parallel/tensor_parallel.py": 2,
    "triax/testing.py": 1, "triax/train/data.py": 2,
    "triax/runs/files.py": 4, "triax/config/strict.py": 3, "triax/train/trainer.py": 3,
}


def module_files() -> dict[str, str]:
    """{dotted module name: path} of every module in triax/."""
    modules = {}
    for directory, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: str, module: str, is_package: bool, type_only: bool = False):
    """(imported name, line, inside a function) for every import statement in the file; with
    `type_only`, those under `if TYPE_CHECKING:` too."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in (child.body + child.orelse if type_only else child.orelse):
                    visit_statement(other, in_function)
                continue
            visit_statement(child, in_function)

    def visit_statement(child, in_function: bool) -> None:
        if isinstance(child, ast.Import):
            found.extend((alias.name, child.lineno, in_function, None) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:  # relative: resolved against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (child.level - 1)]
                base = ".".join(package + ([base] if base else []))
            found.append((base, child.lineno, in_function, [alias.name for alias in child.names]))
        elif is_package and not in_function and isinstance(child, ast.FunctionDef) and child.name == "__getattr__":
            return  # lazy attributes of the package
        else:
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, False)
    return found


def import_graph(type_only: bool = False) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """The edges between triax's modules (with `type_only`, the imports for type names too), and
    every import inside a function (path, line, text)."""
    modules = module_files()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    in_functions = []
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        for name, line, in_function, names in imports(path, module, is_package, type_only):
            if names is None:
                targets = [name]
            else:  # `from a.b import c`: the submodule a.b.c if there is one, else a.b
                targets = [f"{name}.{item}" if f"{name}.{item}" in modules else name for item in names]
            for target in targets:
                if target in modules and target != module:
                    edges[module].add(target)
            if in_function:
                in_functions.append((path, line, name))
    return edges, in_functions


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return sorted(found)


def one_cycle(edges: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest way round from the component's first module back to itself, for the message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for other in sorted(edges[node] & members):
                if other == start:
                    return paths[node] + [start]
                if other not in paths:
                    paths[other] = paths[node] + [other]
                    following.append(other)
        frontier = following
    return component


def test_no_import_circles():
    edges, _ = import_graph()
    found = circles(edges)
    report = "\n".join(f"  {len(component)} modules: {' -> '.join(one_cycle(edges, component))}"
                       f"\n    all of them: {', '.join(component)}" for component in found)
    assert not found, f"import circles in triax/ (module-level and inside functions):\n{report}"


# Circles closed only by imports for type names, from before that rule: each may only shrink or go.
# Every circle from before the rule has gone; the list stays so a new one cannot be added silently.
TYPE_ONLY_CIRCLES_BEFORE_THE_RULE: list[set[str]] = [
]


def test_no_import_circles_through_type_only_imports():
    edges, _ = import_graph(type_only=True)
    new = [component for component in circles(edges)
           if not any(set(component) <= known for known in TYPE_ONLY_CIRCLES_BEFORE_THE_RULE)]
    report = "\n".join(f"  {' -> '.join(one_cycle(edges, component))}" for component in new)
    assert not new, ("import circles through imports for type names (under `if TYPE_CHECKING:`); put the "
                     f"shared types in a small module both import:\n{report}")


def test_the_circle_finder_finds_a_circle_through_a_function_import(tmp_path):
    # The check itself: a circle closed by an import inside a function is found.
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]] and one_cycle(edges, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    package = tmp_path / "pkg.py"
    package.write_text("def late():\n    from triax import x\n")
    assert imports(str(package), "triax.pkg", False) == [("triax", 2, True, ["x"])]
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from triax.a import b\n")
    assert imports(str(typed), "triax.typed", False)[1:] == []
    assert imports(str(typed), "triax.typed", False, type_only=True)[1:] == [("triax.a", 3, False, ["b"])]


def unexplained_imports_in_functions() -> Counter:
    _, in_functions = import_graph()
    unexplained = Counter()
    for path, line, _ in in_functions:
        lines = open(path, encoding="utf-8").read().splitlines()
        said = lines[line - 1] + (lines[line - 2] if line >= 2 else "")
        if REASON not in said:
            unexplained[os.path.relpath(path, ROOT)] += 1
    return unexplained


def test_imports_inside_functions_state_their_reason():
    worse = {path: count for path, count in unexplained_imports_in_functions().items()
             if count > UNEXPLAINED_BEFORE_THE_RULE.get(path, 0)}
    assert not worse, ("imports inside functions without a `# deferred: <reason>` comment on the line "
                       f"or the line above (or move them to the top of the file): {worse}")
