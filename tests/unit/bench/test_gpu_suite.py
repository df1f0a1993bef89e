"""`triax doctor --gpu-suite` without a GPU: it runs to its end within its budget, says which checks
need a GPU, and writes a report of the documented schema. (On a GPU it is the acceptance itself:
docs/performance.md, "On a GPU".)"""

import json
import os

import pytest
import torch

from support import TESTS_DIR
from triax.commands import doctor as doctor_command
from triax.commands.cli import main as triax_main
from triax.bench import gpu_suite

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the suite's CPU behaviour")
# The suite runs the gpu tests in a pytest of their own.
multiprocess = pytest.mark.multiprocess
TESTS = TESTS_DIR
CHECK_KEYS = {"name", "status", "figure", "advice", "seconds", "needs_gpu", "detail"}


def run_suite(tmp_path, *args):
    report = tmp_path / "report.json"
    code = doctor_command.main(["--gpu-suite", "--json", str(report), *args])
    return code, json.loads(report.read_text())


@multiprocess
def test_runs_to_its_end_and_names_what_needs_a_gpu(tmp_path, capsys):
    code, report = run_suite(tmp_path, "--no-compile", "--budget", "900")
    assert code == 0
    assert report["schema"] == gpu_suite.SCHEMA and report["gpu"] is False and report["failed"] is False
    assert {"started", "seconds", "budget_s", "device", "targets", "checks", "summary"} <= set(report)
    names = [check["name"] for check in report["checks"]]
    assert names == ["environment", *gpu_suite.SHARES]
    for check in report["checks"]:
        assert set(check) == CHECK_KEYS and check["status"] in gpu_suite.STATUSES
        if check["needs_gpu"]:  # every one of them ran as far as a CPU allows and said why it stops there
            assert check["status"] == "skipped", check
            assert "GPU" in check["advice"] or "GPU" in check["figure"], check
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["gpu tests"]["detail"]["counts"]["skipped"] >= 9  # collected, each skipped with its reason
    for name in ("gpt2-124m", "llama-125m"):  # the smoke shape really trained, both ways
        detail = checks[name]["detail"]
        assert detail["trainer"]["tokens_per_s"] > 0 and len(detail["trainer"]["windows"]) == 3
        assert all(run["tokens_per_s"] > 0 for run in detail["handwritten"]) and detail["ratio"] > 0
    assert checks["snapshot"]["detail"]["sync"]["write_s"] > 0
    assert "report" in capsys.readouterr().out


def test_a_spent_budget_skips_the_rest_with_the_reason(tmp_path):
    code, report = run_suite(tmp_path, "--budget", "1", "--skip", "gpu tests")
    assert code == 0
    skipped = [check for check in report["checks"] if check["name"] not in ("environment", "gpu tests")]
    assert skipped and all(check["status"] == "skipped" and "budget" in check["figure"] + check["advice"]
                           for check in skipped)


def test_reads_pytests_junit_report(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="ok"/>'
                   '<testcase classname="a" name="bad"><failure message="boom">trace</failure></testcase>'
                   '<testcase classname="a" name="gone"><skipped message="no GPU"/></testcase>'
                   '</testsuite></testsuites>')
    counts, failures = gpu_suite.read_junit(str(xml))
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    assert failures == [{"test": "a::bad", "message": "boom", "text": "trace"}]
    found = {os.path.basename(path) for path in gpu_suite.gpu_test_files(TESTS)}
    assert {"test_gpu.py", "test_pipe_equivalence.py"} <= found and "test_gpu_suite.py" not in found


@pytest.mark.parametrize("args, words", [(["--budget", "-5"], "--budget -5"), (["--budget", "nan"], "--budget nan"),
                                         (["--skip", "gpu tests,bogus"], "bogus"),
                                         (["--batch-cap", "0"], "--batch-cap 0")])
def test_bad_options_are_one_line(args, words, capsys):
    assert triax_main(["doctor", "--gpu-suite", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
