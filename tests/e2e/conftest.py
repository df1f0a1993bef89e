"""Every test under tests/e2e/ is an end-to-end story (a first hour, the documented commands, runs
side by side with nanoGPT, transformers and TRL, a Slurm cluster, faults): marked `e2e`, so
`pytest -m "not e2e"` runs the unit tests alone."""

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)
