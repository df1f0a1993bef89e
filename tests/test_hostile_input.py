"""Hostile and careless input on every command: one line, exit code 2, no traceback, nothing changed.

Each case runs the CLI's main in-process inside a sandbox: its own temp dir ($TMPDIR and
tempfile's), home and cache dir, and working directory, all under one root. The whole root is
listed before and after, so "nothing outside the run directory changed" covers the temp dir, the
run dir's parent and the default config location at once.
"""

import os
import tempfile

import pytest

from triax.cli import main as triax_main

from helpers import tiny_overrides


def tree_listing(root):
    """Every path under root with its size and modification time (files) or a marker (dirs)."""
    listing = {}
    for directory, dirs, files in os.walk(root):
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


# ---- triax train: config strictness and value ranges ------------------------------------------------

TRAIN_CASES = {
    # name: (overrides, words the line must contain)
    "typo with +": (["+trainer.max_step=5"], ["unknown key trainer.max_step", "did you mean trainer.max_steps?"]),
    "typo with ++": (["++trainer.max_step=5"], ["unknown key trainer.max_step", "did you mean trainer.max_steps?"]),
    "typo without +": (["trainer.max_step=5"], ["unknown key trainer.max_step", "did you mean trainer.max_steps?"]),
    "key in the wrong section": (["trainer.lr=0.1"], ["unknown key trainer.lr", "did you mean optim.lr?"]),
    "new top-level key": (["+foo.bar=1"], ["unknown key foo.bar"]),
    "key below a value": (["+model.n_head.x=1"], ["unknown key model.n_head.x"]),
    "env interpolation": (["trainer.seed=${oc.env:HOME}"], ["trainer.seed", "interpolations"]),
    "interpolation in a list": (["optim.betas=[${optim.lr},0.9]"], ["optim.betas.0", "interpolations"]),
    "deleting a key": (["~trainer.max_steps"], ["deletes a key"]),
    "hydra setting": (["hydra.run.dir=elsewhere"], ["hydra.run.dir", "no effect"]),
    "package override": (["trainer@x.max_steps=3"], ["package"]),
    "unparsable override": (["trainer.max_steps=="], ["cannot read the override"]),
    "negative lr": (["optim.lr=-1"], ["optim.lr=-1.0", "positive"]),
    "nan lr": (["optim.lr=nan"], ["optim.lr=nan"]),
    "min_lr above lr": (["optim.min_lr=1"], ["optim.min_lr"]),
    "beta of 1": (["optim.betas=[0.9,1.0]"], ["optim.betas"]),
    "bogus device": (["trainer.device=bogus"], ["trainer.device='bogus'", "cuda:N"]),
    "dropout of 1": (["model.dropout=1.0"], ["model.dropout"]),
    "zero layers": (["model.n_layer=0"], ["model.n_layer=0"]),
    "negative grad_clip": (["trainer.grad_clip=-1"], ["trainer.grad_clip"]),
    "train_split of 1": (["data.train_split=1"], ["data.train_split"]),
    "negative seed": (["trainer.seed=-1"], ["trainer.seed"]),
    "zero tp": (["parallel.tp=0"], ["parallel.tp=0"]),
    "unknown schedule": (["parallel.pp_schedule=zigzag"], ["parallel.pp_schedule"]),
    "zero bucket": (["parallel.bucket_mb=0"], ["parallel.bucket_mb"]),
    "empty run dir name": (["trainer.run_dir=''"], ["trainer.run_dir"]),
}


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_train_refuses(name, sandbox, tiny_corpus):
    overrides, words = TRAIN_CASES[name]
    run_dir = sandbox.work / "runs" / "a"
    sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus), *overrides], *words)
    assert not (sandbox.work / "runs").exists()


def test_experiment_file_from_searchpath_is_checked_too(sandbox, tiny_corpus):
    """hydra.searchpath is accepted (documented); the files it finds meet the same schema."""
    experiments = sandbox.root / "home" / "conf" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "typo.yaml").write_text("# @package _global_\ntrainer:\n  max_stepz: 3\n")
    (experiments / "env.yaml").write_text("# @package _global_\ntrainer:\n  snapshot_dir: ${oc.env:HOME}\n")
    base = [*tiny_overrides(sandbox.work / "run", tiny_corpus), f"hydra.searchpath=[file://{experiments.parent}]"]
    sandbox.refused(["train", *base, "+experiment=typo"], "unknown key trainer.max_stepz",
                    "did you mean trainer.max_steps?")
    sandbox.refused(["train", *base, "+experiment=env"], "trainer.snapshot_dir", "interpolations")
    sandbox.refused(["train", *base, "+experiment=absent"], "experiment/absent", "available: env, gpt2_train_cfg, typo")


def test_searchpath_experiment_is_used(sandbox):
    from triax.train.config import compose_config

    experiments = sandbox.root / "home" / "conf" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "short.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 7\n")
    config = compose_config([f"hydra.searchpath=[file://{experiments.parent}]", "+experiment=short"])
    assert config.trainer.max_steps == 7
