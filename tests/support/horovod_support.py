"""Shared bits of the triax.horovod tests: where the worker scripts are, and an environment in
which child processes import this checkout of triax."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import triax.horovod as hvd
from triax.testing import quiet_env
from support import HOROVOD_WORKERS_DIR, REPO_DIR

REPO = Path(REPO_DIR)
WORKERS = Path(HOROVOD_WORKERS_DIR)


def child_env(**extra: str) -> dict[str, str]:
    env = quiet_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    # A parent that called hvd.init() exported these; a child must find its own place.
    for name in [n for n in env if n.startswith("HOROVOD_")]:
        del env[name]
    return env


@pytest.fixture
def horovod(monkeypatch):
    """This process joined as a one-process Horovod job, and left afterwards with the environment restored."""
    for name in ("RANK", "WORLD_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    saved = dict(os.environ)
    hvd.init()
    yield hvd
    hvd.shutdown()
    os.environ.clear()  # init() exports HOROVOD_*; keep them out of later tests' children
    os.environ.update(saved)
