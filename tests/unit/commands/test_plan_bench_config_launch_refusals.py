"""`triax plan`, `bench`, `config`, `launch` and `env` refuse bad arguments in one line, exit code 2,
before torchrun starts and without writing anything; a real `python -m triax` process does the same."""

import os

import pytest

from triax.commands.cli import main as triax_main


PLAN = ["plan", "--world", "4", "--memory-gb", "16", "--model", "gpt-nano"]


PLAN_CASES = {
    "zero tflops": (["--tflops", "0"], ["--tflops 0.0"]),
    "nan bandwidth": (["--bandwidth", "nan"], ["--bandwidth nan"]),
    "negative batch": (["--global-batch", "-8"], ["--global-batch -8"]),
    "negative sequence": (["--seq", "-1"], ["--seq -1"]),
    "zero vocabulary": (["--vocab", "0"], ["--vocab 0"]),
    "negative microbatches": (["--microbatches", "-1"], ["--microbatches -1"]),
    "huge world": (["--world", "100000000"], ["--world 100000000"]),
    "unknown schedule": (["--pp-schedule", "zigzag"], ["zigzag"]),
    "zero world": (["--world", "0"], ["--world 0"]),
    # argparse would keep the last without a word
    "repeated option": (["--seq", "5", "--seq=7"], ["option --seq given more than once", "give it once"]),
    # named as typed, not as the model.* key it becomes
    "huge sequence": (["--seq", "99999999999"], ["--seq 99999999999", "bound of 2097152"]),
    "huge vocabulary": (["--vocab", "99999999999"], ["--vocab 99999999999", "bound of 16777216"]),
}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_plan_refuses(name, sandbox):
    options, words = PLAN_CASES[name]
    base = ["plan", "--memory-gb", "16", "--model", "gpt-nano"] if "--world" in options else PLAN  # given once
    sandbox.refused([*base, *options], *words)


BENCH_CASES = {
    "zero block size": (["--block-size", "0"], ["--block-size 0"]),
    "zero batch": (["--batch-size", "0"], ["--batch-size 0"]),
    "negative warmup": (["--warmup", "-1"], ["--warmup -1"]),
    "bogus device": (["--device", "tpu9"], ["--device 'tpu9'"]),
    "zero timeout": (["--timeout", "0"], ["--timeout 0.0"]),
}


@pytest.mark.parametrize("name", list(BENCH_CASES))
def test_bench_refuses_before_torchrun(name, sandbox):
    options, words = BENCH_CASES[name]
    sandbox.refused(["bench", "--out", str(sandbox.work / "results"), *options], *words)


def test_bench_out_existing_file(sandbox):
    (sandbox.work / "results").write_text("mine")
    sandbox.refused(["bench", "--out", str(sandbox.work / "results")], "not a directory")


def test_bench_out_with_foreign_results_needs_force(sandbox):
    (sandbox.work / "results").mkdir()
    (sandbox.work / "results" / "bench.json").write_text("my own notes")
    sandbox.refused(["bench", "--out", str(sandbox.work / "results")], "bench.json", "--force")


def test_config_file_that_is_a_directory(sandbox):
    (sandbox.work / "configs").mkdir()
    sandbox.refused(["config", "--default", "--config-file", str(sandbox.work / "configs")], "is a directory")
    sandbox.refused(["config", "--show", "--config-file", str(sandbox.work / "configs")], "not a file")
    sandbox.refused(["launch", "--config-file", str(sandbox.work / "configs"), "x.py"], "not a file")


def test_config_never_overwrites_a_foreign_file_without_force(sandbox, capsys):
    precious = sandbox.work / "settings.yaml"
    precious.write_text("mine: 1\n")
    sandbox.refused(["config", "--default", "--config-file", str(precious)], "not written by `triax config`")
    assert triax_main(["config", "--default", "--config-file", str(precious), "--force"]) == 0
    assert triax_main(["config", "--default", "--config-file", str(precious)]) == 0  # now triax's own


LAUNCH_CASES = {
    "missing script": (["missing.py"], ["'missing.py' does not exist"]),
    "script is a directory": ([".."], ["is a directory"]),
    "missing module": (["-m", "no_such_module_xyz"], ["no_such_module_xyz"]),
    "zero processes": (["--num-processes", "0", "x.py"], ["num_processes=0"]),
    "negative restarts": (["--max-restarts", "-1", "x.py"], ["max_restarts=-1"]),
    "bad rdzv conf": (["--rdzv-conf", "oops", "x.py"], ["--rdzv-conf 'oops'"]),
    "malformed port": (["--main-process-port", "http", "x.py"], ["--main-process-port", "http"]),
}


@pytest.mark.parametrize("name", list(LAUNCH_CASES))
def test_launch_refuses_before_torchrun(name, sandbox):
    options, words = LAUNCH_CASES[name]
    sandbox.refused(["launch", *options], *words)


def test_env_unknown_option(sandbox):
    sandbox.refused(["env", "--jsn"], "--jsn")


@pytest.mark.multiprocess
@pytest.mark.parametrize("argv", [["train", "+trainer.max_step=5"], ["plan", "--world", "2", "--memory-gb", "8",
                                                                      "--tflops", "0"]])
def test_real_process_exits_2_with_one_line(argv, tmp_path):
    """The same refusals from a real `python -m triax`: exit status 2, one line, no traceback,
    nothing written in the working directory."""
    import subprocess
    import sys

    from triax.testing import quiet_env

    result = subprocess.run([sys.executable, "-m", "triax", *argv], capture_output=True, text=True,
                            env=quiet_env(TMPDIR=str(tmp_path)), cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert os.listdir(tmp_path) == []
