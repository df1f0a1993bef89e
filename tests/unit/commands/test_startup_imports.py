"""A command's first second: what `--help`, a misspelt key or a plan needs is parsed and answered
without importing what only a real run uses (transformers' and Hydra's machinery, torch's
distributed tensor, pipeline and checkpoint packages, the trainer). Checked by the modules a fresh
interpreter holds once the command has answered, not by a clock."""

import subprocess
import sys

import pytest

from triax.testing import quiet_env

pytestmark = pytest.mark.multiprocess

# What a real run imports and these answers must not: each costs a large share of a second.
RUN_ONLY = ("transformers", "tokenizers", "tensorboard", "torch.utils.tensorboard", "torch.distributed.tensor",
            "torch.distributed.pipelining", "torch.distributed.checkpoint", "sympy", "triax.train.trainer",
            "triax.eval.scoring", "triax.interop.formats")

PROBE = """
import sys
from triax.commands.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print("MODULES", " ".join(sorted(sys.modules)), file=sys.stderr)
sys.exit(code)
"""


def loaded(*argv: str) -> tuple[int, str, set[str]]:
    """(exit code, stdout, the modules imported) of `triax ARGV` in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=quiet_env(),
                            timeout=120)
    line = next(line for line in result.stderr.splitlines() if line.startswith("MODULES "))
    return result.returncode, result.stdout + result.stderr.replace(line, ""), set(line.split()[1:])


@pytest.mark.parametrize("argv, also_absent", [
    (["eval", "--help"], ("hydra", "omegaconf")),
    (["train", "--help"], ("hydra", "omegaconf")),
    (["doctor", "--help"], ()),
    (["plan", "--model", "gpt2", "--world", "4", "--memory-gb", "24", "--global-batch", "32", "--seq", "1024"],
     ("hydra", "omegaconf")),
])
def test_help_and_plans_import_no_run_machinery(argv, also_absent):
    code, output, modules = loaded(*argv)
    assert code == 0, output
    assert not modules & {*RUN_ONLY, *also_absent}, sorted(modules & {*RUN_ONLY, *also_absent})


def test_a_misspelt_key_is_answered_without_the_trainer_or_the_adapters():
    """Hydra's override grammar reads the key (the one part of Hydra it needs); the LoRA
    adapters (torch.distributed.tensor) and the readers of other tools' files are not imported."""
    code, output, modules = loaded("train", "foo.bar=1")
    assert code == 2 and "unknown key foo.bar" in output, output
    unwanted = {*RUN_ONLY, "triax.models.lora"}
    assert not modules & unwanted, sorted(modules & unwanted)
