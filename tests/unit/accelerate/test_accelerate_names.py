"""triax.accelerate's modules against the installed Accelerate's, name by name.

Every public name of every mirrored Accelerate module must be provided by triax's counterpart
(its `__all__`) or listed in triax.accelerate._internal.surface.ABSENT with what to use instead: a name a
new Accelerate release adds fails here until it is one or the other. Absent names still import
and raise one line (UnsupportedFeatureError) when used. docs/accelerate.md's table is rendered
from the same tables.
"""

import importlib
import inspect
import pathlib
import re
import types

import pytest

from triax.accelerate._internal import surface
from triax.accelerate._internal.errors import UnsupportedFeatureError
from triax.errors import TriaxError
from support import REPO_DIR

ROOT = pathlib.Path(REPO_DIR)


def accelerate_public_names(module_name: str) -> set[str]:
    """What a script can import from an Accelerate module: names without a leading underscore that
    are not modules and are Accelerate's own. A package (accelerate, accelerate.utils) re-exports
    from its submodules; another module's names are those it defines (functions and classes whose
    __module__ is it, and UPPER_CASE constants assigned in its source)."""
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        owner = getattr(value, "__module__", None)
        if hasattr(module, "__path__"):
            public = owner is None or str(owner).startswith("accelerate")
        elif owner is None or not isinstance(owner, str):
            public = name.isupper() and re.search(rf"^{name}\s*[:=]", source, re.MULTILINE) is not None
        else:
            public = owner == module_name
        if public:
            names.add(name)
    return names


def counterpart(module_name: str):
    return importlib.import_module(surface.triax_module_name(module_name))


@pytest.fixture(scope="module")
def accelerate():
    pytest.importorskip("accelerate", reason="Accelerate is in the test extras: pip install -e '.[test]'")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an Accelerate module may warn about optional packages on import
        for module_name in surface.MODULES:
            importlib.import_module(module_name)


@pytest.mark.parametrize("module_name", surface.MODULES)
def test_every_accelerate_name_is_provided_or_absent_with_a_reason(accelerate, module_name):
    theirs = accelerate_public_names(module_name)
    ours = counterpart(module_name)
    provided = set(ours.__all__)
    absent = set(surface.ABSENT.get(module_name, {}))
    missing = sorted(theirs - provided - absent)
    assert not missing, f"{module_name} has names triax neither provides nor lists in surface.ABSENT: {missing}"
    assert not provided & absent, f"provided and listed absent: {sorted(provided & absent)}"
    assert not absent - theirs, f"surface.ABSENT lists names {module_name} does not have: {sorted(absent - theirs)}"
    differs = set(surface.DIFFERS.get(module_name, {}))
    assert differs <= provided & theirs, f"surface.DIFFERS lists names not provided: {sorted(differs - provided)}"
    elsewhere = surface.ELSEWHERE.get(module_name, {})
    assert provided - theirs == set(elsewhere), "a name triax adds to this module must say where Accelerate keeps it"
    for name, home in elsewhere.items():
        if home.startswith("accelerate"):
            assert hasattr(importlib.import_module(home), name), (name, home)


@pytest.mark.parametrize("module_name", surface.MODULES)
def test_provided_names_are_the_same_kind_of_thing(accelerate, module_name):
    """A class stays a class (scripts subclass it and check isinstance), a function a function."""
    theirs = importlib.import_module(module_name)
    ours = counterpart(module_name)
    for name in set(ours.__all__) & accelerate_public_names(module_name):
        mine, original = getattr(ours, name), getattr(theirs, name)
        assert inspect.isclass(mine) == inspect.isclass(original), name
        assert callable(mine) == callable(original), name
        if not callable(original):
            assert type(mine) is type(original) or isinstance(mine, type(original)), name


@pytest.mark.parametrize("module_name", [name for name in surface.MODULES if surface.ABSENT.get(name)])
def test_absent_names_import_and_raise_one_line_naming_the_alternative(module_name):
    ours = counterpart(module_name)
    for name, why in surface.ABSENT[module_name].items():
        assert not name.isupper(), f"{name}: a constant cannot refuse when used; provide its value"
        assert name in dir(ours)
        stand_in = getattr(ours, name)
        assert getattr(ours, name) is stand_in  # made once
        assert inspect.isclass(stand_in) == (name[0].isupper())
        with pytest.raises(UnsupportedFeatureError) as caught:
            stand_in("any", arguments=1)
        message = str(caught.value)
        assert isinstance(caught.value, TriaxError) and isinstance(caught.value, NotImplementedError)
        assert "\n" not in message and message == f"{module_name}.{name}: {why}"
    with pytest.raises(AttributeError):
        getattr(ours, "no_such_name_anywhere")


def test_star_imports_work():
    for module_name in surface.MODULES:
        namespace = {}
        exec(f"from {surface.triax_module_name(module_name)} import *", namespace)
        assert set(counterpart(module_name).__all__) <= set(namespace)


def test_a_script_import_block_runs_with_only_the_package_name_changed():
    """What transformers' *_no_trainer examples and Accelerate's own examples import."""
    from triax.accelerate import Accelerator, DistributedType  # noqa: F401
    from triax.accelerate.logging import get_logger  # noqa: F401
    from triax.accelerate.utils import DeepSpeedPlugin, is_deepspeed_available, set_seed, tqdm  # noqa: F401


def test_the_docs_table_is_rendered_from_the_tables():
    hook = importlib.util.spec_from_file_location("accelerate_names", ROOT / "scripts" / "accelerate_names.py")
    module = importlib.util.module_from_spec(hook)
    hook.loader.exec_module(module)
    assert module.MARKER in (ROOT / "docs" / "accelerate.md").read_text()
    table = surface.markdown_table()
    for module_name in surface.MODULES:
        assert f"### `{module_name}` → `triax.{module_name}`" in table
    assert "| `DeepSpeedPlugin` | absent | " + surface.DEEPSPEED in table
    assert "`get_logger`" in table and "`FullyShardedDataParallelPlugin`" in table
