"""The commands of docs/getting-started.md, run as written (with a few training steps only), so
the page breaks the suite when a command it shows stops working.

A fenced block right after a `<!-- tested -->` line is run: a `bash` block line by line (each must
exit 0), a `console` block as `$ command` lines followed by the exact output expected.
"""

import re
import shlex
import sys
from pathlib import Path

import pytest

from triax.testing import free_port, quiet_env, run

PAGE = Path(__file__).resolve().parent.parent / "docs" / "getting-started.md"
# Appended to every `triax train` so the page's runs take seconds: few steps, no evaluation.
FEW_STEPS = ["trainer.max_steps=3", "trainer.eval_every=0", "trainer.log_every=1"]


def marked_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block marked `<!-- tested -->`."""
    pattern = re.compile(r"^<!-- tested -->\n```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
    return [(match.group(1), match.group(2).splitlines()) for match in pattern.finditer(text)]


def as_command(line: str) -> list[str]:
    """A documented command as this interpreter runs it: `triax` is `python -m triax`, torchrun
    gets a free loopback port (other jobs may hold torchrun's default), and `triax train` few steps."""
    words = shlex.split(line, comments=True)
    if words[0] == "triax":
        words = [sys.executable, "-m", "triax", *words[1:]]
    elif words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", "--master-addr=127.0.0.1",
                 f"--master-port={free_port()}", *words[1:]]
    else:
        raise AssertionError(f"getting-started.md: no rule to run {line!r}; add one to this test")
    if "triax" in words and words[words.index("triax") + 1:words.index("triax") + 2] == ["train"]:
        words += FEW_STEPS
    return words


def test_the_page_marks_its_main_commands_as_tested():
    commands = [line for language, lines in marked_blocks(PAGE.read_text()) for line in lines]
    for expected in ("triax train", "triax generate", "triax export", "torchrun"):
        assert any(line.startswith(expected) for line in commands), f"{expected} is not in a tested block"


@pytest.mark.multiprocess
def test_getting_started_commands_work(tmp_path):
    blocks = marked_blocks(PAGE.read_text())
    assert blocks, "getting-started.md has no <!-- tested --> blocks"
    for language, lines in blocks:
        if language == "bash":
            for line in lines:
                if line.strip() and not line.lstrip().startswith("#"):
                    run(as_command(line), timeout=600, cwd=str(tmp_path), env=quiet_env())
        elif language == "console":
            commands = [number for number, line in enumerate(lines) if line.startswith("$ ")]
            for start, end in zip(commands, [*commands[1:], len(lines)]):
                result = run(as_command(lines[start][2:]), timeout=300, cwd=str(tmp_path),
                             env=quiet_env(), check=False)
                expected = "\n".join(lines[start + 1:end]).strip()
                assert (result.stdout + result.stderr).strip() == expected, lines[start]
        else:
            raise AssertionError(f"getting-started.md: a tested block in {language!r}; use bash or console")
    assert (tmp_path / "model.safetensors").stat().st_size > 0
