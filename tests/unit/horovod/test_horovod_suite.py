"""Runs tests/support/horovod_workers/suite.py, a Horovod user's suite in which every rank runs every test,
on 2 and 3 processes, and reports each test as pytest sees it."""

import re

import pytest

from support.horovod_support import WORKERS, child_env
from support.forked import launch


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [2, 3])
def test_horovod_suite(processes):
    result = launch(processes, [str(WORKERS / "suite.py")], timeout=300, env=child_env(), check=False)
    verdicts = re.findall(r"^(PASS|FAIL) (\w+)", result.stdout, flags=re.M)
    assert len(verdicts) >= 5, result.stdout[-3000:] + result.stderr[-3000:]  # every test reported
    failed = [name for verdict, name in verdicts if verdict == "FAIL"]
    assert not failed and result.returncode == 0, result.stdout[-4000:]
