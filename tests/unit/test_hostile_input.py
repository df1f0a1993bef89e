"""Hostile and careless input on every command: one line, exit code 2, no traceback, nothing changed.

Each case runs the CLI's main in-process inside a sandbox: its own temp dir ($TMPDIR and
tempfile's), home and cache dir, and working directory, all under one root. The whole root is
listed before and after, so "nothing outside the run directory changed" covers the temp dir, the
run dir's parent and the default config location at once.
"""

import os

import pytest

from triax.cli import main as triax_main

from support.helpers import tiny_overrides
from support.sandbox import sandbox  # noqa: F401  (the fixture)
from support import WORKERS_DIR


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


# ---- triax generate / export: arguments and a damaged run directory ----------------------------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One tiny finished run, trained in-process once for every generate/export case."""
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


GENERATE_CASES = {
    "zero temperature": (["--temperature", "0"], ["--temperature 0.0", "--greedy"]),
    "negative temperature": (["--temperature", "-1"], ["--temperature -1.0"]),
    "nan temperature": (["--temperature", "nan"], ["--temperature nan"]),
    "zero top-k": (["--top-k", "0"], ["--top-k 0"]),
    "vanishing temperature": (["--temperature", "1e-300"], ["--temperature 1e-300"]),
    "unbounded tokens": (["--tokens", str(10**12)], ["--tokens"]),
    "empty prompt": (["--prompt", ""], ["--prompt ''"]),
    "prompt outside the vocabulary": (["--prompt", "XYZ"], ["'XYZ'", "not in the training vocabulary"]),
    "bogus device": (["--device", "bogus"], ["--device 'bogus'"]),
    "negative tokens": (["--tokens", "-5"], ["--tokens -5"]),
    "negative seed": (["--seed", "-1"], ["--seed -1"]),
    "malformed number": (["--top-k", "many"], ["--top-k", "many"]),
    "unknown option": (["--colour", "red"], ["--colour"]),
}


@pytest.mark.parametrize("name", list(GENERATE_CASES))
def test_generate_refuses(name, sandbox, run_copy):
    options, words = GENERATE_CASES[name]
    sandbox.refused(["generate", str(run_copy), *options], *words)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_cuda_without_cuda(sandbox, run_copy):
    sandbox.refused(["generate", str(run_copy), "--device", "cuda"], "CUDA is not available")


def test_train_refusing_an_existing_run_leaves_no_new_run_dir(sandbox, run_copy, tiny_corpus):
    """resume=false next to existing snapshots is refused before the new run dir is created."""
    new_run = sandbox.work / "new-run"
    overrides = tiny_overrides(new_run, tiny_corpus, **{"trainer.snapshot_dir": run_copy / "snapshots",
                                                        "trainer.resume": "false"})
    sandbox.refused(["train", *overrides], "already holds a run")
    assert not new_run.exists()


def test_generate_works_on_the_copy(sandbox, run_copy, capsys):
    """The cases above fail for their argument alone: the same run generates fine."""
    assert triax_main(["generate", str(run_copy), "--prompt", "ab", "--tokens", "5", "--top-k", "2"]) == 0
    assert capsys.readouterr().out.startswith("ab")


DAMAGED_MODEL_JSON = {
    "huge n_embd": ('{"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32768}',
                    ["model.json", "stores only"]),
    "beyond any limit": ('{"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 10000000000}',
                         ["model.json", "n_embd=10000000000"]),
    "not JSON": ("{nope", ["model.json", "damaged"]),
    "a list": ("[]", ["model.json", "damaged"]),
    "wrong type": ('{"vocab_size": "65", "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}',
                   ["vocab_size='65'"]),
    "unknown key": ('{"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "evil": 1}',
                    ["unknown key(s) evil"]),
}


@pytest.mark.parametrize("name", list(DAMAGED_MODEL_JSON))
@pytest.mark.parametrize("command", ["generate", "export"])
def test_damaged_model_json_is_refused_before_allocating(name, command, sandbox, run_copy):
    text, words = DAMAGED_MODEL_JSON[name]
    (run_copy / "model.json").write_text(text)
    extra = [str(sandbox.work / "out.safetensors")] if command == "export" else []
    sandbox.refused([command, str(run_copy), *extra], *words)


def test_damaged_vocabulary_is_refused(sandbox, run_copy):
    (run_copy / "vocab.json").write_text('{"chars": 5}')
    sandbox.refused(["generate", str(run_copy)], "vocab.json", "damaged")


def test_not_a_run_directory(sandbox):
    sandbox.refused(["generate", str(sandbox.work)], "not a triax run directory")


def test_export_to_a_directory(sandbox, run_copy):
    (sandbox.work / "exports").mkdir()
    sandbox.refused(["export", str(run_copy), str(sandbox.work / "exports")], "is a directory")


def test_export_into_a_missing_directory(sandbox, run_copy):
    sandbox.refused(["export", str(run_copy), str(sandbox.work / "nowhere" / "m.safetensors")], "does not exist")


def test_export_over_the_snapshot_own_file(sandbox, run_copy):
    from triax import checkpoint

    snapshot = checkpoint.latest_snapshot(str(run_copy / "snapshots"))
    target = os.path.join(snapshot, "model.safetensors")
    sandbox.refused(["export", str(run_copy), target, "--force"], "inside the run's snapshots")


def test_export_over_the_run_model_json(sandbox, run_copy):
    sandbox.refused(["export", str(run_copy), str(run_copy / "model.json"), "--force"], "run's own model.json")


def test_export_over_a_file_triax_did_not_write_needs_force(sandbox, run_copy, capsys):
    precious = sandbox.work / "notes.txt"
    precious.write_text("mine")
    sandbox.refused(["export", str(run_copy), str(precious)], "not written by triax", "--force")
    assert precious.read_text() == "mine"
    # An earlier export is triax's own: replaced without --force; a foreign file with --force.
    out = sandbox.work / "model.safetensors"
    assert triax_main(["export", str(run_copy), str(out)]) == 0
    assert triax_main(["export", str(run_copy), str(out)]) == 0
    assert triax_main(["export", str(run_copy), str(precious), "--force"]) == 0
    leftovers = [name for name in os.listdir(sandbox.work) if name.endswith(".tmp")]
    assert leftovers == []


# ---- triax plan / bench / config / launch / env ---------------------------------------------------

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
}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_plan_refuses(name, sandbox):
    options, words = PLAN_CASES[name]
    sandbox.refused([*PLAN, *options], *words)


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


# ---- one rank fails, every rank stops together (plain processes: no torchrun agent to kill them) ------

def start_ranks(command, tmp_path, world=2, **env):
    """Start `world` plain processes of `command` as ranks of one job; return their outputs."""
    import subprocess

    from triax.testing import free_port, quiet_env

    port = str(free_port())
    processes = []
    for rank in range(world):
        rank_env = quiet_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                             LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                             GLOO_SOCKET_IFNAME="lo", **env)
        processes.append(subprocess.Popen(command, env=rank_env, cwd=tmp_path, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    try:
        for process in processes:
            # Far below the 120 s collective timeout the workers use: a rank left waiting fails this.
            out, err = process.communicate(timeout=90)
            results.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


AGREEMENT_WORKER = os.path.join(WORKERS_DIR, "agreement_worker.py")


@pytest.mark.multiprocess
def test_raise_together_stops_every_rank(tmp_path):
    import sys

    results = start_ranks([sys.executable, AGREEMENT_WORKER, "generic", str(tmp_path)], tmp_path)
    assert "rank 0: OSError: disk full" in results[0][1], results[0]
    assert "rank 1: RankFailedError: rank 0 failed while writing a file on rank 0" in results[1][1], results[1]


@pytest.mark.multiprocess
def test_one_rank_damaged_rng_file_makes_every_rank_fall_back(tmp_path):
    import sys

    results = start_ranks([sys.executable, AGREEMENT_WORKER, "rng", str(tmp_path)], tmp_path)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"rank {rank}: loaded step_00000001" in out, (out, err)
    assert os.path.isdir(tmp_path / "snapshots" / "step_00000002.corrupt")


@pytest.mark.multiprocess
def test_one_rank_failing_to_load_stops_every_rank(tmp_path):
    import sys

    results = start_ranks([sys.executable, AGREEMENT_WORKER, "fatal", str(tmp_path)], tmp_path)
    assert "rank 1: SnapshotError" in results[1][1] and "does not fit" in results[1][1], results[1]
    assert "rank 0: SnapshotError" in results[0][1] and "failed on another rank" in results[0][1], results[0]


@pytest.mark.multiprocess
def test_trainer_rank_0_failing_to_write_run_files_stops_every_rank(tmp_path, tiny_corpus):
    import sys

    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)  # rank 0 alone opens it, and cannot
    results = start_ranks([sys.executable, "-m", "triax", "train", *tiny_overrides(run_dir, tiny_corpus)], tmp_path)
    for rank, (code, _, err) in enumerate(results):
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (rank, err)
    assert "cannot write" in results[0][2] and "metrics.jsonl" in results[0][2], results[0]
    assert "rank 0 failed while writing the run files" in results[1][2], results[1]


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


# ---- files inside a run directory: no link followed out of it, no FIFO, no huge file ----------------


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


@pytest.mark.parametrize("name", ["vocab.json", "config.yaml", "model.json"])
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_fifo_in_the_run_is_refused_at_once(name, command, sandbox, run_copy):
    os.remove(run_copy / name)
    os.mkfifo(run_copy / name)
    extra = [str(sandbox.work / "out.safetensors")] if command == "export" else []
    sandbox.refused([command, str(run_copy), *extra], name)


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_an_alias_bomb_in_the_runs_config_is_one_line(command, sandbox, run_copy):
    """The run's config.yaml goes through the one bounded YAML reader (triax/safe_yaml.py): a few
    hundred bytes of nested aliases are refused by count, not expanded until memory runs out."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
              f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
              for i in range(8)]
    (run_copy / "config.yaml").write_text("\n".join(lines) + "\n")
    sandbox.refused([command, str(run_copy)], "config.yaml")


def test_a_huge_sparse_model_json_is_not_read(sandbox, run_copy):
    with open(run_copy / "model.json", "r+b") as handle:
        handle.truncate(6 * 2**30)
    sandbox.refused(["generate", str(run_copy)], "model.json", "bytes")


def test_failed_hf_export_leaves_nothing_and_the_retry_works(sandbox, run_copy, monkeypatch, capsys):
    from triax.train import hf_export

    out = sandbox.work / "hf"
    real = hf_export.hf_config

    def broken(config):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "hf_config", broken)
    with pytest.raises(OSError):
        triax_main(["export", str(run_copy), str(out), "--format", "hf"])
    assert not out.exists()
    monkeypatch.setattr(hf_export, "hf_config", real)
    assert triax_main(["export", str(run_copy), str(out), "--format", "hf"]) == 0
    assert (out / "model.safetensors").stat().st_size > 0


# ---- one job per run directory ------------------------------------------------------------------------


def test_a_run_directory_in_use_is_refused_with_its_holder(sandbox, tiny_corpus):
    import fcntl

    run_dir = sandbox.work / "run"
    run_dir.mkdir()
    with open(run_dir / ".triax.lock", "w") as holder:
        holder.write("host elsewhere pid 4242\n")
        holder.flush()
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: a rival job
        sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus)], "in use by another triax job",
                        "pid 4242")
    # The holder's exit releases it: the same command now trains.
    from triax.train import run_lock

    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})]) == 0
    run_lock.unlock_run_dir(str(run_dir))


def test_the_lock_file_goes_with_the_job(sandbox, tiny_corpus):
    run_dir = sandbox.work / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})]) == 0
    assert not (run_dir / ".triax.lock").exists()
    assert (run_dir / "snapshots").is_dir()


def test_a_lock_taken_on_a_file_its_holder_removed_is_taken_again(tmp_path, monkeypatch):
    """A job that ends removes its lock file; a rival that opened the old file just before gets
    the lock on a file no longer at the path: it must take the path's current file instead, or a
    third job could hold the run directory at the same time."""
    import fcntl

    from triax.train import run_lock

    real_flock = run_lock.fcntl.flock
    removed = []

    def flock_after_the_holder_left(descriptor, operation):
        real_flock(descriptor, operation)
        if not removed:  # the previous holder unlinked the file between our open and our lock
            removed.append(True)
            os.unlink(tmp_path / ".triax.lock")

    monkeypatch.setattr(run_lock.fcntl, "flock", flock_after_the_holder_left)
    run_lock.lock_run_dir(str(tmp_path))
    try:
        with open(tmp_path / ".triax.lock") as rival:
            with pytest.raises(BlockingIOError):
                fcntl.flock(rival.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # the file at the path is held
    finally:
        run_lock.unlock_run_dir(str(tmp_path), remove=True)
    assert removed and not (tmp_path / ".triax.lock").exists()


# ---- numbers from a re-signed state.json are finite and in range -----------------------------------


def _resign(snapshot, relative, text):
    import hashlib
    import json

    data = text.encode()
    with open(os.path.join(snapshot, relative), "wb") as handle:
        handle.write(data)
    manifest_path = os.path.join(snapshot, "manifest.json")
    manifest = json.load(open(manifest_path))
    manifest["files"][relative] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    open(manifest_path, "w").write(json.dumps(manifest))


def _two_snapshots(root):
    import torch

    from triax import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = {"base_lrs": [0.01], "last_epoch": 3}
    good = checkpoint.save_snapshot(str(root), 3, model, optimizer, {"scheduler": schedule})
    newest = checkpoint.save_snapshot(str(root), 4, model, optimizer, {"scheduler": schedule})
    return model, optimizer, good, newest


STATE_EDITS = {
    "NaN learning rates": lambda text: text.replace('"base_lrs": [\n   0.01\n  ]', '"base_lrs": [NaN]'),
    "infinite beta": lambda text: text.replace('"betas": [\n    0.9,', '"betas": [\n    Infinity,'),
    "overflowing beta": lambda text: text.replace('"betas": [\n    0.9,', '"betas": [\n    1e999,'),
    "beta of 2": lambda text: text.replace('"betas": [\n    0.9,', '"betas": [\n    2.0,'),
    "negative eps": lambda text: text.replace('"eps": 1e-08', '"eps": -1e-08'),
    "position of 2^61": lambda text: text.replace('"last_epoch": 3', f'"last_epoch": {2**61}'),
}


@pytest.mark.parametrize("name", list(STATE_EDITS))
def test_a_resigned_state_with_numbers_out_of_range_falls_back(name, tmp_path):
    from triax import checkpoint

    model, optimizer, good, newest = _two_snapshots(tmp_path)
    text = open(os.path.join(newest, "state.json")).read()
    edited = STATE_EDITS[name](text)
    assert edited != text, "the edit did not apply"
    _resign(newest, "state.json", edited)
    messages = []
    path, state = checkpoint.load_latest_snapshot(str(tmp_path), model, optimizer, report=messages.append)
    assert path == good and state["step"] == 3, messages
    assert all(group["lr"] == 0.01 and list(group["betas"]) == [0.9, 0.999] and group["eps"] == 1e-8
               for group in optimizer.param_groups)


# The Accelerator's checkpoint folders: numbers out of range, hostile pickles, links and FIFOs are
# refused in tests/unit/accelerate/test_accelerate_folder.py.


# ---- bounds before allocation ----------------------------------------------------------------------


def _shards_edit(snapshot, edit):
    import json

    shards = json.load(open(os.path.join(snapshot, "shards.json")))
    edit(shards["tensors"])
    _resign(snapshot, "shards.json", json.dumps(shards))


def _repeat_chunk(tensors, copies):
    """One tensor made of `copies` chunks that all name the same bytes of the file."""
    entry = tensors["model/weight"]
    chunk = entry["chunks"][0]
    rows = chunk["sizes"][0]
    entry["size"] = [rows * copies, *entry["size"][1:]]
    entry["chunks"] = [dict(chunk, offsets=[rows * i, *chunk["offsets"][1:]]) for i in range(copies)]


def test_chunks_sharing_file_bytes_are_refused(tmp_path):
    from triax import checkpoint

    _, _, good, newest = _two_snapshots(tmp_path)
    _shards_edit(newest, lambda tensors: _repeat_chunk(tensors, 256))
    with pytest.raises(checkpoint.SnapshotCorruptError, match="share bytes"):
        checkpoint.open_snapshot(newest)


def test_twenty_thousand_overlapping_chunks_are_refused_quickly(tmp_path):
    """The overlap check is O(n log n): 20,000 chunks on one spot end in a refusal, not a hang."""
    from triax import checkpoint

    _, _, good, newest = _two_snapshots(tmp_path)

    def pile(tensors):
        entry = tensors["model/weight"]
        chunk = entry["chunks"][0]
        entry["size"] = [20000 * chunk["sizes"][0], *entry["size"][1:]]
        # all at offset 0: the volumes add up but every chunk covers the same first rows
        entry["chunks"] = [dict(chunk) for _ in range(20000)]

    _shards_edit(newest, pile)
    with pytest.raises(checkpoint.SnapshotCorruptError, match="overlap|share bytes"):
        checkpoint.open_snapshot(newest)


def test_model_json_larger_than_the_snapshot_tensors_is_refused(sandbox, run_copy):
    """A sparse 2 TiB file in the snapshot does not make a huge model.json believable: the model
    is matched against the snapshot's tensors, before it is built."""
    import json

    from triax import checkpoint

    snapshot = checkpoint.latest_snapshot(str(run_copy / "snapshots"))
    with open(os.path.join(snapshot, "padding.bin"), "wb") as handle:
        handle.truncate(2 * 2**40)
    values = json.loads((run_copy / "model.json").read_text())
    values["n_embd"] = 2**15
    # A consistent model.json (the widths that follow from n_embd too), so only its size is wrong.
    values.update(n_head=256, n_kv_head=256, head_dim=128, intermediate_size=4 * 2**15)
    (run_copy / "model.json").write_text(json.dumps(values))
    sandbox.refused(["generate", str(run_copy)], "model.json", "stores only")


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


def test_tokenize_never_writes_through_planted_links(sandbox, capsys):
    """A symlinked train.bin.tmp is replaced, not truncated through; a dangling meta.json link
    counts as an existing output (refused without --overwrite) and --overwrite replaces the link."""
    corpus = sandbox.work / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = sandbox.work / "tokens"
    out.mkdir()
    precious = sandbox.root / "precious.bin"
    precious.write_bytes(b"keep me")
    os.symlink(precious, out / "train.bin.tmp")
    os.symlink(sandbox.root / "created-outside.json", out / "meta.json")
    sandbox.refused(["tokenize", str(corpus), "--out", str(out), "--vocab-size", "280"], "meta.json", "--overwrite")
    assert triax_main(["tokenize", str(corpus), "--out", str(out), "--vocab-size", "280", "--overwrite"]) == 0
    assert precious.read_bytes() == b"keep me"
    assert not (sandbox.root / "created-outside.json").exists()
    assert not os.path.islink(out / "meta.json") and (out / "meta.json").stat().st_size > 0


def test_tokenize_with_a_fifo_tokenizer_is_refused_at_once(sandbox):
    corpus = sandbox.work / "corpus.txt"
    corpus.write_text("hello world\n" * 50)
    os.mkfifo(sandbox.work / "tok.json")
    sandbox.refused(["tokenize", str(corpus), "--out", str(sandbox.work / "tokens"), "--tokenizer",
                     str(sandbox.work / "tok.json")], "tok.json")


def test_experiment_with_a_python_tag_is_one_line(sandbox, tiny_corpus):
    experiments = sandbox.root / "home" / "conf" / "experiment"
    experiments.mkdir(parents=True)
    (experiments / "evil.yaml").write_text("# @package _global_\ntrainer:\n  seed: !!python/object/apply:os.getpid []\n")
    base = [*tiny_overrides(sandbox.work / "run", tiny_corpus), f"hydra.searchpath=[file://{experiments.parent}]"]
    sandbox.refused(["train", *base, "+experiment=evil"], "not plain YAML")


def test_a_run_config_cannot_send_generate_to_another_host(sandbox, run_copy, monkeypatch):
    import fsspec
    import yaml

    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["trainer"]["snapshot_dir"] = "ftp://attacker.example/"
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config))

    def no_network(*args, **kwargs):
        raise AssertionError("generate tried to reach the host")

    monkeypatch.setattr(fsspec, "filesystem", no_network)
    monkeypatch.setattr(fsspec.core, "url_to_fs", no_network)
    sandbox.refused(["generate", str(run_copy)], "ftp://", "snapshot_dir")
    sandbox.refused(["export", str(run_copy), str(sandbox.work / "m.safetensors")], "ftp://")


# ---- what a bad snapshot, a full disk or an odd path leaves behind ------------------------------------


def _damage_tensor_bytes(snapshot):
    """Flip one byte of the tensor data: the manifest and shard metadata still vouch for the file's
    size, so only the chunk's sha256, checked as it is read, finds it."""
    shard = os.path.join(snapshot, "shards", "rank_00000.bin")
    with open(shard, "r+b") as handle:
        handle.seek(8)
        byte = handle.read(1)
        handle.seek(8)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_damaged_tensor_bytes_make_export_and_generate_fall_back(tmp_path, tiny_corpus, capsys):
    run_dir = tmp_path / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{
        "trainer.max_steps": 2, "trainer.save_every": 1})]) == 0
    _damage_tensor_bytes(str(run_dir / "snapshots" / "step_00000002"))
    for argv in (["export", str(run_dir), str(tmp_path / "m.safetensors")],
                 ["export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"],
                 ["generate", str(run_dir), "--tokens", "3", "--prompt", "the"]):
        capsys.readouterr()
        assert triax_main(argv) == 0, argv
        captured = capsys.readouterr()
        assert "sha256" in captured.err and "trying the previous snapshot" in captured.err, captured.err
    assert (tmp_path / "m.safetensors").exists() and (tmp_path / "hf" / "model.safetensors").exists()
    assert os.path.isdir(run_dir / "snapshots" / "step_00000002")  # read-only commands move nothing


def test_hf_export_inside_the_snapshots_is_refused(sandbox, run_copy):
    sandbox.refused(["export", str(run_copy), str(run_copy / "snapshots" / "hf"), "--format", "hf"],
                    "inside the run's snapshots")


def test_requarantining_a_step_keeps_the_earlier_copy(tmp_path):
    from triax import checkpoint

    model, optimizer, _, newest = _two_snapshots(tmp_path)
    first = checkpoint.quarantine_snapshot(newest)
    second_write = checkpoint.save_snapshot(str(tmp_path), 4, model, optimizer, {})
    second = checkpoint.quarantine_snapshot(second_write)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    checkpoint.remove_snapshots(str(tmp_path))  # trainer.overwrite=true clears every copy
    assert os.listdir(tmp_path) == []


def test_overwrite_refuses_a_symlinked_snapshots_directory(sandbox, tiny_corpus):
    elsewhere = sandbox.root / "elsewhere"
    (elsewhere / "step_00000001").mkdir(parents=True)
    run_dir = sandbox.work / "run"
    run_dir.mkdir()
    os.symlink(elsewhere, run_dir / "snapshots")
    sandbox.refused(["train", *tiny_overrides(run_dir, tiny_corpus, **{
        "trainer.resume": "false", "trainer.overwrite": "true"})], "snapshots", "symlink", "trainer.snapshot_dir")
    assert os.listdir(elsewhere) == ["step_00000001"]


def test_metrics_that_cannot_be_written_are_dropped_with_one_warning(tmp_path, capsys):
    import errno

    from triax.tracking.throughput import MetricsLogger

    logger = MetricsLogger(str(tmp_path), enabled=True, loggers=["jsonl"], progress=False)

    class FullDisk:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    (jsonl,) = logger.trackers
    jsonl._handle.close()
    jsonl._handle = FullDisk()
    logger.log(1, {"loss": 1.0})
    logger.log(2, {"loss": 0.5})  # training goes on; nothing more is attempted
    logger.close()
    err = capsys.readouterr().err
    assert err.count("cannot append") == 1 and "No space left" in err


def test_control_characters_in_a_path_are_escaped(sandbox, run_copy):
    """A message that quotes a path as it is (here: model.json is damaged) still prints one line,
    with the newline and the terminal escape shown escaped."""
    evil = sandbox.work / "evil\n\x1b[2Jrun"
    os.rename(run_copy, evil)
    (evil / "model.json").write_text("{nope")
    err = sandbox.refused(["generate", str(evil)], "model.json", "damaged")
    assert "\x1b" not in err and "\\n\\x1b[2Jrun" in err


def test_accelerator_state_dataloader_entries_are_null_or_objects():
    from triax.accelerate.saving import validate_state
    from triax.checkpoint import SnapshotError

    state = {"schedulers": [], "custom": [], "optimizer_steps": [], "stateless_optimizers": [],
             "saved_models": [0], "num_models": 1, "micro_step": 0, "scaler": {}, "units": [[[0], []]],
             "dataloaders": [None, {"_num_yielded": 3}]}
    validate_state(state, "s")
    state["dataloaders"][0] = 5
    with pytest.raises(SnapshotError, match="neither null nor an object"):
        validate_state(state, "s")


def test_accelerator_state_keeps_an_infinity_it_wrote_but_not_in_a_learning_rate():
    import json
    import math

    from triax.accelerate.saving import from_json, to_json
    from triax.checkpoint.numbers import bad_number, finite_float, reject_constant

    plateau = {"best": math.inf, "mode_worse": -math.inf, "last_epoch": 0}
    text = json.dumps(to_json(plateau))
    stored = json.loads(text, parse_constant=reject_constant, parse_float=finite_float)  # strict JSON reads it
    assert from_json(stored) == plateau and bad_number({"schedulers": [stored]}) is None
    assert "base_lrs" in bad_number({"schedulers": [to_json({"base_lrs": [math.nan], "last_epoch": 0})]})
    assert "betas" in bad_number({"optimizer": to_json({"betas": (1.5, 0.999)})})


def test_hostfile_that_is_a_fifo_is_refused_at_once(tmp_path):
    from triax.errors import TriaxError
    from triax.horovod.hosts import parse_hosts

    import signal

    def expired(*_):
        raise TimeoutError("blocked on the FIFO")

    os.mkfifo(tmp_path / "hosts")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(30)
    try:
        with pytest.raises(TriaxError, match="not a regular file"):
            parse_hosts(None, str(tmp_path / "hosts"), None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    (tmp_path / "real").write_text("localhost slots=2\n")
    os.symlink(tmp_path / "real", tmp_path / "link")  # the user's own argument: a link they name is read
    assert parse_hosts(None, str(tmp_path / "link"), None) == [("localhost", 2)]


def test_long_lines_are_cut_and_ordinary_text_is_not():
    from triax.data.tokenize_files import LONGEST_PIECE, pieces

    text = "a b\nccc\n" * 10
    assert pieces(text) == text.splitlines(keepends=True)
    blob = "x y" * (30 * LONGEST_PIECE)
    assert "".join(pieces(blob)) == blob and max(map(len, pieces(blob))) <= LONGEST_PIECE


def test_tokenize_a_file_without_line_breaks(tmp_path):
    """One word of 1.2 MB: byte-level BPE on it whole takes minutes (400 KB took over a minute)."""
    import random
    import signal

    def expired(*_):
        raise TimeoutError("tokenize took over 60 s")

    blob = tmp_path / "blob.txt"
    blob.write_text("".join(random.Random(0).choices("abcdefghij", k=1_200_000)))
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    try:
        assert triax_main(["tokenize", str(blob), "--out", str(tmp_path / "t"), "--vocab-size", "300"]) == 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
