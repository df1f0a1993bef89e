"""A finished job ends cleanly: every door tears its process group down before the interpreter
finalizes (triax.runtime.process_group), so gloo's threads never meet a finalizing interpreter.

The failure this guards against was intermittent: on a loaded machine, the README's Accelerator
demo under `triax launch --num-processes 2` trained, printed its last loss, and then a rank died
with "terminate called without an active exception" (SIGABRT, exit -6): a gloo thread, delayed by
the load after its last collective, asked for the GIL while the interpreter was finalizing. Here
the demo runs RUNS times back to back while LOAD busy processes compete for the CPUs; every run
must exit 0 with no abort.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from triax.testing import quiet_env, run_torchrun
from support import ACCELERATE_SCRIPTS_DIR, REPO_DIR, WORKERS_DIR

pytestmark = pytest.mark.multiprocess

ROOT = Path(REPO_DIR)
RUNS = 3  # about 10 s each on a quiet 2-core machine; a loaded one takes several times that
LOAD = 2  # busy processes beside the job's two ranks: more runnable threads than cores


def readme_accelerator_demo() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    return next(block for block in blocks if "from triax import Accelerator" in block)


def test_the_readme_demo_under_triax_launch_never_aborts_at_exit_on_a_loaded_machine(tmp_path):
    (tmp_path / "demo.py").write_text(readme_accelerator_demo())
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(LOAD)]
    try:
        for run in range(RUNS):
            result = subprocess.run([sys.executable, "-m", "triax", "launch", "--num-processes", "2",
                                     "--main_process_port", "0", "demo.py"], cwd=tmp_path, env=quiet_env(),
                                    capture_output=True, text=True, timeout=600)
            output = result.stdout + result.stderr
            assert result.returncode == 0 and "terminate called" not in output, \
                f"run {run + 1} of {RUNS}: exit {result.returncode}\n{output[-3000:]}"
            assert "last loss" in output, output[-3000:]
    finally:
        for process in load:
            process.kill()
            process.wait()


@pytest.mark.parametrize("ending", ["normal", "raise"])
def test_the_accelerators_process_group_is_torn_down_before_the_interpreter_finalizes(ending):
    from support.forked import launch

    result = launch(2, [str(Path(ACCELERATE_SCRIPTS_DIR) / "exit_paths.py"), ending], timeout=300,
                    env=quiet_env(), check=False)
    clean = result.stdout.count("group alive at exit: False; gloo threads runnable: 0")
    # A rank that fails has the other stopped (as torchrun does), possibly before its own report.
    assert clean == 2 if ending == "normal" else clean >= 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "group alive at exit: True" not in result.stdout and "terminate called" not in result.stderr
    if ending == "raise":
        assert "the script failed after its last step" in result.stderr


def test_a_script_that_makes_and_destroys_its_own_group_ends_cleanly_under_triax():
    """`python -m triax.ddp_boost script.py`: the script makes and destroys its own gloo group, and
    PyTorch's PowerSGD hook releases its `.then` callbacks on gloo's thread, where triax cannot keep
    the works. A release delayed past the script's end (a thread waiting for a CPU on a loaded
    machine) aborted the finished job; triax's exit handler lets gloo's threads finish whoever made
    the group. The same script without triax aborts: the test can fail."""
    script = str(Path(WORKERS_DIR) / "exit_callback.py")
    env = quiet_env(PYTHONPATH=str(ROOT))
    plain = run_torchrun(2, [script, "busy-plain"], timeout=120, env=env, check=False)
    assert plain.returncode != 0 and "exitcode  : -6" in plain.stderr, (
        "without triax the script was expected to abort; without that this test proves nothing\n"
        + plain.stdout[-2000:] + plain.stderr[-2000:])
    guarded = run_torchrun(2, [script, "busy-triax"], timeout=120, env=env, check=False)
    assert guarded.returncode == 0, guarded.stdout[-2000:] + guarded.stderr[-4000:]
    assert guarded.stdout.count("callback released") == 2, guarded.stdout[-2000:]
