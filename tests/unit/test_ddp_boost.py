"""triax.ddp_boost: an unchanged plain DDP script under `triax launch --grad-compression fp16`
trains exactly as the same script with PyTorch's fp16 hook registered by hand."""

import os
import sys

import pytest
import torch
from safetensors import safe_open

from triax.errors import TriaxError
from triax.testing import quiet_env, run
from support import REPO_DIR, WORKERS_DIR

SCRIPT = os.path.join(WORKERS_DIR, "plain_ddp.py")
REPO = REPO_DIR


def trained(path):
    with safe_open(str(path), "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()


def launch(*args):
    env = quiet_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH", "")]))
    run([sys.executable, "-m", "triax", "launch", "--num-processes", "2", "--cpu", "--main-process-port", "0",
         *args], env=env, timeout=300)


@pytest.mark.multiprocess
def test_unchanged_script_equals_the_hook_applied_by_hand(tmp_path):
    launch("--grad-compression", "fp16", "--bucket-cap-mb", "1", SCRIPT, str(tmp_path / "boosted.st"))
    launch(SCRIPT, str(tmp_path / "by_hand.st"), "by-hand")
    launch(SCRIPT, str(tmp_path / "plain.st"))
    boosted, boosted_meta = trained(tmp_path / "boosted.st")
    by_hand, _ = trained(tmp_path / "by_hand.st")
    plain, plain_meta = trained(tmp_path / "plain.st")
    assert boosted_meta["hooks"] == "1" and plain_meta["hooks"] == "0"
    assert float(boosted_meta["bucket_cap_mb"]) == 1.0 and float(plain_meta["bucket_cap_mb"]) == 25.0
    for name in by_hand:
        assert torch.equal(boosted[name], by_hand[name]), name  # the same arithmetic, bit for bit
    assert any(not torch.equal(boosted[name], plain[name]) for name in plain)  # fp16 did change the sums


def test_install_refuses_unknown_settings(monkeypatch):
    import triax.ddp_boost as boost

    try:
        monkeypatch.setenv(boost.COMPRESSION_ENV, "zip")
        with pytest.raises(TriaxError, match="grad_compression must be one of"):
            boost.install()
        monkeypatch.setenv(boost.COMPRESSION_ENV, "bf16")
        monkeypatch.setenv(boost.BUCKET_ENV, "-3")
        with pytest.raises(TriaxError, match="at least"):
            boost.install()
    finally:
        boost.uninstall()


def test_the_scripts_globals_live_until_the_interpreter_ends(tmp_path):
    """`python -m triax.ddp_boost script.py` keeps the script's objects (its DDP model, and through
    it the process group) alive after the script's last line, as `python script.py` does: dropped
    there, the group's last reference could go on gloo's thread (exit -6 after a good run)."""
    script = tmp_path / "script.py"
    # No function in the script: a function's globals would keep its objects alive on their own.
    script.write_text("import builtins, weakref\n"
                      "class Witness:\n    pass\n"
                      "witness = Witness()\n"
                      "builtins._triax_probe = weakref.ref(witness)\n")
    result = run([sys.executable, "-c", "import builtins, gc, sys, triax.ddp_boost as boost; boost._run([sys.argv[1]]); "
                  "gc.collect(); print('kept' if builtins._triax_probe() is not None else 'dropped')", str(script)],
                 env=quiet_env(PYTHONPATH=REPO), timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "kept", result.stdout + result.stderr
