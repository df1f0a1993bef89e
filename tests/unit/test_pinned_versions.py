"""The versions the tests run against live in one place, tests/constraints.txt: every package is pinned
there (`==`), torch is left to its own pin, the table in docs/architecture.md names the same versions
of the libraries the doors stand in for, and pyproject.toml's minimums admit them."""

import re

import pytest

from support import REPO_DIR

CONSTRAINTS = f"{REPO_DIR}/tests/constraints.txt"
# The libraries the doors are compared with, as docs/architecture.md's table names them.
PEERS = {"Accelerate": "accelerate", "transformers": "transformers", "PEFT": "peft", "TRL": "trl"}


def pins() -> dict[str, str]:
    found = {}
    for line in open(CONSTRAINTS, encoding="utf-8"):
        line = line.split("#")[0].strip()
        if line:
            name, separator, version = line.partition("==")
            assert separator and version, f"tests/constraints.txt: {line!r} is not pinned with =="
            found[re.sub(r"[-_.]+", "-", name).lower()] = version
    return found


def test_every_test_dependency_is_pinned_and_torch_is_not():
    pinned = pins()
    assert "torch" not in pinned  # TRIAX_TORCH_SPEC chooses the build (CPU or CUDA)
    extras = open(f"{REPO_DIR}/pyproject.toml", encoding="utf-8").read()
    test_extra = re.search(r"^test = \[(.*?)\]", extras, re.MULTILINE | re.DOTALL).group(1)
    for requirement in re.findall(r'"([^"]+)"', test_extra):
        name = re.split(r"[<>=!~\[ ]", requirement)[0]
        assert re.sub(r"[-_.]+", "-", name).lower() in pinned, f"{name} (the test extra) has no pin"


@pytest.mark.parametrize("label", sorted(PEERS))
def test_the_documented_versions_are_the_pinned_ones(label):
    docs = open(f"{REPO_DIR}/docs/architecture.md", encoding="utf-8").read()
    rows = re.findall(rf"^\| [^|]+ \| {label} \| ([^ |]+) \|$", docs, re.MULTILINE)
    assert rows == [pins()[PEERS[label]]], f"docs/architecture.md's version of {label}: {rows}"


@pytest.mark.parametrize("package", sorted(PEERS.values()))
def test_pyproject_minimums_admit_the_pins(package):
    from packaging.specifiers import SpecifierSet

    extras = open(f"{REPO_DIR}/pyproject.toml", encoding="utf-8").read()
    requirement = re.search(rf'"{package}([<>=!~][^"]*)?"', extras)
    assert requirement, f"{package} is not in pyproject.toml's extras"
    assert pins()[package] in SpecifierSet(requirement.group(1) or ""), requirement.group(0)
