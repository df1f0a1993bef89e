"""`triax train` refuses hostile and careless input in one line, exit code 2, nothing changed: config
strictness and value ranges, experiment files, files planted in the run and data directories, sizes
with no bound. Each case runs the CLI's main in-process inside a sandbox (support/sandbox.py)."""

import os

import pytest

from support.helpers import tiny_overrides
from triax.commands.cli import main as triax_main


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
    "experiment as a path": (["+experiment=../model/gpt2"], ["not a plain experiment name"]),
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
    "negative logits limit": (["parallel.max_logits_mb=-1"], ["parallel.max_logits_mb=-1.0", "0 for no limit"]),
    "nan logits limit": (["parallel.max_logits_mb=nan"], ["parallel.max_logits_mb=nan"]),
    "empty run dir name": (["trainer.run_dir=''"], ["trainer.run_dir"]),
    # bytes that are not UTF-8, as a shell passes them (surrogate escapes): TensorBoard could not write them
    # a value of 120 kB echoed: the line keeps its start (the key) and its end (the advice)
    "a huge value": ([f"trainer.device={'x' * 120_000}"], ["trainer.device='xxx", "characters left out",
                                                         "use auto, cpu, cuda or cuda:N"]),
    # numbers at the ends of their range: the DPO loss would be inf (sigmoid) or NaN (ipo)
    "dpo.beta of 1e300": (["data.task=preference", "dpo.beta=1e300"], ["dpo.beta=1e+300", "[1e-06, 1e+06]"]),
    "dpo.beta of 1e-320 with ipo": (["dpo.beta=1e-320", "dpo.loss_type=ipo"], ["dpo.beta=1e-320", "overflows"]),
    "dpo keys without DPO": (["dpo.beta=0.5"], ["dpo.beta=0.5 with data.task=char", "data.task=preference only"]),
    "packing characters": (["data.packing=true"], ["data.packing=True", "data.task=char has no documents"]),
    "grpo keys without GRPO": (["grpo.beta=0.1", "grpo.num_generations=4"],
                               ["grpo.num_generations=4, grpo.beta=0.1 with data.task=char", "data.task=grpo only"]),
    "non-UTF-8 run dir": (["trainer.run_dir=runs/r\udcff", "trainer.loggers=[tensorboard]"],
                          ["trainer.run_dir=", "UTF-8"]),
    "non-UTF-8 snapshot dir": (["trainer.snapshot_dir=runs/s\udcff"], ["trainer.snapshot_dir=", "UTF-8"]),
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
    from triax.config import compose_config

    experiments = sandbox.root / "home" / "conf" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "short.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 7\n")
    config = compose_config([f"hydra.searchpath=[file://{experiments.parent}]", "+experiment=short"])
    assert config.trainer.max_steps == 7


def test_train_refusing_an_existing_run_leaves_no_new_run_dir(sandbox, run_copy, tiny_corpus):
    """resume=false next to existing snapshots is refused before the new run dir is created."""
    new_run = sandbox.work / "new-run"
    overrides = tiny_overrides(new_run, tiny_corpus, **{"trainer.snapshot_dir": run_copy / "snapshots",
                                                        "trainer.resume": "false"})
    sandbox.refused(["train", *overrides], "already holds a run")
    assert not new_run.exists()


def test_train_replaces_planted_links_never_their_targets(sandbox, tiny_corpus, capsys):
    """config.yaml and model.json planted as links to files outside: the run writes its own files
    in their place and the link targets keep their bytes."""
    run_dir = sandbox.work / "run"
    run_dir.mkdir()
    outside = {name: sandbox.root / f"outside-{name}" for name in ("config.yaml", "model.json", "vocab.json")}
    for name, target in outside.items():
        target.write_text("precious")
        os.symlink(target, run_dir / name)
    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})]) == 0
    for name, target in outside.items():
        assert target.read_text() == "precious", name
        assert not os.path.islink(run_dir / name) and (run_dir / name).stat().st_size > 0, name


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_train_refuses_a_metrics_log_that_is_not_a_regular_file(kind, sandbox, tiny_corpus):
    run_dir = sandbox.work / "run"
    run_dir.mkdir()
    target = sandbox.root / "outside.jsonl"
    target.write_text("precious\n")
    if kind == "symlink":
        os.symlink(target, run_dir / "metrics.jsonl")
    else:
        os.mkfifo(run_dir / "metrics.jsonl")
    err = sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus)], "metrics.jsonl")
    assert "symlink" in err if kind == "symlink" else "regular file" in err
    assert target.read_text() == "precious\n"


def test_train_refuses_a_symlinked_tensorboard_directory(sandbox, tiny_corpus):
    run_dir = sandbox.work / "run"
    run_dir.mkdir()
    (sandbox.root / "elsewhere").mkdir()
    os.symlink(sandbox.root / "elsewhere", run_dir / "tensorboard")
    sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus)], "tensorboard", "symlink")
    assert os.listdir(sandbox.root / "elsewhere") == []


@pytest.mark.parametrize("override", ["model.n_embd=1000000", "model.n_layer=100000"])
def test_model_sizes_have_a_bound(override, sandbox, tiny_corpus):
    run_dir = sandbox.work / "runs" / "a"
    sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus), override], override.split("=")[0],
                    "bound")
    assert not (sandbox.work / "runs").exists()


def test_meta_json_vocabulary_has_a_bound(sandbox):
    import numpy as np

    data = sandbox.work / "data"
    data.mkdir()
    np.arange(200, dtype=np.uint16).tofile(data / "train.bin")
    np.arange(200, dtype=np.uint16).tofile(data / "val.bin")
    (data / "meta.json").write_text('{"vocab_size": %d, "dtype": "int64"}' % 2**40)
    run_dir = sandbox.work / "runs" / "a"
    sandbox.refused(["train", *tiny_overrides(run_dir, str(data), **{"data.task": "tokens"})], "vocab_size",
                    str(2**40))
    assert not (sandbox.work / "runs").exists()


@pytest.mark.parametrize("name", ["meta.json", "tokenizer.json"])
def test_a_fifo_in_a_data_directory_is_refused_at_once(name, sandbox):
    import numpy as np

    data = sandbox.work / "data"
    data.mkdir()
    np.arange(200, dtype=np.uint16).tofile(data / "train.bin")
    np.arange(200, dtype=np.uint16).tofile(data / "val.bin")
    if name == "tokenizer.json":
        (data / "meta.json").write_text('{"vocab_size": 256, "dtype": "uint16", "tokenizer": "tokenizer.json"}')
    os.mkfifo(data / name)
    run_dir = sandbox.work / "runs" / "a"
    sandbox.refused(["train", *tiny_overrides(run_dir, str(data), **{"data.task": "tokens"})], name)


def test_experiment_with_a_python_tag_is_one_line(sandbox, tiny_corpus):
    experiments = sandbox.root / "home" / "conf" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "evil.yaml").write_text("# @package _global_\ntrainer:\n  seed: !!python/object/apply:os.getpid []\n")
    base = [*tiny_overrides(sandbox.work / "run", tiny_corpus), f"hydra.searchpath=[file://{experiments.parent}]"]
    sandbox.refused(["train", *base, "+experiment=evil"], "not plain YAML")


def test_overwrite_refuses_a_symlinked_snapshots_directory(sandbox, tiny_corpus):
    elsewhere = sandbox.root / "elsewhere"
    (elsewhere / "step_00000001").mkdir(parents=True)
    run_dir = sandbox.work / "run"
    run_dir.mkdir()
    os.symlink(elsewhere, run_dir / "snapshots")
    sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus, **{
        "trainer.resume": "false", "trainer.overwrite": "true"})], "snapshots", "symlink", "trainer.snapshot_dir")
    assert os.listdir(elsewhere) == ["step_00000001"]


def test_a_loss_no_longer_finite_stops_the_run(sandbox, tiny_corpus, capsys):
    """A learning rate that blows the weights up: the second step's loss is NaN. The run stops in one
    line, exit 2, before that state is logged or saved; the last finite snapshot (step 1) stays the newest."""
    run_dir = sandbox.work / "run"
    overrides = tiny_overrides(run_dir, tiny_corpus, **{"optim.lr": 1e30, "optim.warmup_steps": 0,
                                                      "trainer.save_every": 1, "trainer.log_every": 3})
    capsys.readouterr()
    assert triax_main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped being finite at step 2" in err[0] and "step_00000001" in err[0], err
    assert sorted(os.listdir(run_dir / "snapshots")) == ["step_00000001"]
    assert "nan" not in (run_dir / "metrics.jsonl").read_text().lower()
