"""The sandbox every hostile-input test runs a command in: its own temp dir ($TMPDIR and
tempfile's), home and cache dir, and working directory, all under one root. The whole root is
listed before and after, so "nothing outside the run directory changed" covers the temp dir, the
run dir's parent and the default config location at once.

Its fixtures (sandbox, trained_run, run_copy) are registered for every test by tests/conftest.py."""

import os
import tempfile

import pytest

from support.helpers import tiny_overrides
from triax.commands.cli import main as triax_main


def tree_listing(root):
    """Every path under root with its size and modification time (files) or a marker (dirs)."""
    listing = {}
    for directory, dirs, files in os.walk(root):
        # torch's own compile cache in $TMPDIR (made on first use of inductor), not a triax file
        dirs[:] = [name for name in dirs if not name.startswith("torchinductor_")]
        for name in dirs:
            listing[os.path.relpath(os.path.join(directory, name), root)] = "dir"
        for name in files:
            path = os.path.join(directory, name)
            stat = os.lstat(path)
            listing[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return listing


class Sandbox:
    def __init__(self, root, capsys):
        self.root, self.capsys = root, capsys
        self.tmp = root / "tmp"
        self.work = root / "work"
        for path in (self.tmp, self.work, root / "home"):
            path.mkdir()

    def refused(self, argv, *words):
        """Run `triax argv`; assert the refusal and return the one line."""
        self.capsys.readouterr()
        before = tree_listing(self.root)
        code = triax_main(list(argv))
        captured = self.capsys.readouterr()
        err = captured.err.strip()
        assert code == 2, (code, err)
        assert "Traceback" not in err, err
        assert len(err.splitlines()) == 1, err
        assert err.startswith("triax: error:"), err
        for word in words:
            assert word in err, f"{word!r} missing from: {err}"
        assert tree_listing(self.root) == before, "a refused command changed files"
        return err


@pytest.fixture
def sandbox(tmp_path, capsys, monkeypatch):
    (tmp_path / "sandbox").mkdir()
    box = Sandbox(tmp_path / "sandbox", capsys)
    monkeypatch.setenv("TMPDIR", str(box.tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(box.tmp))
    monkeypatch.setenv("HOME", str(box.root / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(box.root / "home" / ".cache"))
    monkeypatch.delenv("TRIAX_CONFIG_FILE", raising=False)
    monkeypatch.delenv("TRIAX_DEBUG", raising=False)
    monkeypatch.chdir(box.work)
    return box


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One tiny finished run, trained in-process once for the whole session (every test that damages
    one works on its own copy: run_copy)."""
    import random

    root = tmp_path_factory.mktemp("trained")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(["ab", "cd", "ef"]) for _ in range(10)) for _ in range(200)))
    run_dir = root / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, corpus, **{"trainer.max_steps": 2})]) == 0
    return run_dir


@pytest.fixture
def run_copy(trained_run, sandbox):
    """A copy of the trained run inside the sandbox, free to damage."""
    import shutil

    return shutil.copytree(trained_run, sandbox.work / "run")
