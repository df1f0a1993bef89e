"""What a new user meets in the first hour, each behaviour held: a finished run started again,
a run used from another directory, a launcher's command checked before anything starts."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from triax.arguments import check_command
from triax.commands.cli import main as triax_main
from triax.errors import ConfigError
from triax.testing import quiet_env, run

from support.forked import launch
from support.helpers import tiny_overrides, train
from support import REPO_DIR

ROOT = Path(REPO_DIR)


@pytest.mark.multiprocess
def test_a_finished_run_started_again_says_it_is_complete_and_what_to_do(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 2})
    first = train(overrides)
    again = train(overrides)
    # The run's first line says how many threads it computes with, and why (the tests set OMP_NUM_THREADS=1).
    assert "(single process) with 1 thread each (OMP_NUM_THREADS=1), precision" in first.stdout.splitlines()[0]
    assert "is already complete" in again.stdout, again.stdout
    assert "raise trainer.max_steps" in again.stdout and "another trainer.run_dir" in again.stdout
    assert "done:" not in again.stdout and "training " not in again.stdout  # no summary of 0 steps
    assert not (run_dir / ".triax.lock").exists()  # the run directory is free again
    further = train(overrides + ["trainer.max_steps=4"])
    assert "resuming from" in further.stdout and "done: 2 steps" in further.stdout, further.stdout


@pytest.mark.parametrize("command,expected", [
    (["train.py"], "'train.py' is a Python script, not a program: put python before it"),
    (["python", "trian.py"], "training script 'trian.py' does not exist"),
    (["python", "-u", "-W", "ignore", "nowhere/train.py"], "training script 'nowhere/train.py' does not exist"),
    (["python", "-m", "no_such_module_here"], "module 'no_such_module_here' cannot be found"),
    (["pyhton", "train.py"], "program 'pyhton' is not a program on PATH"),
    (["./train.py"], "'./train.py' is a Python script, not a program"),
    (["python"], "names no script for python to run"),
])
def test_horovodrun_checks_its_command_before_starting(command, expected, tmp_path, monkeypatch, capsys):
    """One line and exit 2, as `triax launch` gives, before any process starts (a start would
    print every worker's traceback, or 'No such file or directory' for a file that is there)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('trained')\n")
    assert triax_main(["horovodrun", "-np", "2", *command]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and expected in error, error


@pytest.mark.parametrize("command", [["python", "-u", "train.py", "--lr", "1"], ["python3", "-m", "json.tool"],
                                     ["python", "-c", "print(1)"], ["./run.sh"], ["bash", "run.sh"]])
def test_a_runnable_command_passes_the_check(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('trained')\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    check_command(command, "triax horovodrun -np 2 python train.py")  # no error


@pytest.mark.multiprocess
def test_a_run_started_with_relative_paths_is_evaluated_and_sampled_from_any_directory(tmp_path, tiny_corpus):
    """The run keeps its data's path absolute (config.yaml), so `triax eval RUN` scores the run's
    own split from another directory; a config.yaml holding a relative path (an older triax's)
    is named as the run's, with where it is relative to."""
    started_in, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    started_in.mkdir()
    elsewhere.mkdir()
    shutil.copy(tiny_corpus, started_in / "input.txt")
    train(tiny_overrides("runs/gpt", "input.txt", **{"trainer.max_steps": 2}), cwd=str(started_in))
    config = yaml.safe_load((started_in / "runs" / "gpt" / "config.yaml").read_text())
    assert config["data"]["path"] == str(started_in / "input.txt")
    run_dir = str(started_in / "runs" / "gpt")
    scored = launch(1, ["-m", "triax", "eval", run_dir, "--json"], cwd=str(elsewhere))
    assert json.loads(scored.stdout.strip().splitlines()[-1])["data"] == ["val split"]
    sampled = launch(1, ["-m", "triax", "generate", run_dir, "--tokens", "5", "--prompt", "the "], cwd=str(elsewhere))
    assert sampled.stdout.startswith("the ")

    config["data"]["path"] = "input.txt"
    (started_in / "runs" / "gpt" / "config.yaml").write_text(yaml.safe_dump(config))
    refused = launch(1, ["-m", "triax", "eval", run_dir], cwd=str(elsewhere), check=False)
    assert refused.returncode == 2
    assert (f"the run's data, data.path 'input.txt' in {run_dir}/config.yaml (relative to the directory the run "
            "was started in") in refused.stderr, refused.stderr


@pytest.mark.parametrize("command", [["generate", "runs/gpt"], ["export", "runs/gpt", "out.safetensors"],
                                     ["eval", "runs/gpt"]])
def test_a_run_directory_that_is_not_there_is_named_with_where_it_was_looked_for(command, tmp_path, monkeypatch,
                                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    assert triax_main(command) == 2
    error = capsys.readouterr().err.strip()
    assert f"'runs/gpt' does not exist (relative to {tmp_path})" in error and "\n" not in error, error


@pytest.mark.multiprocess
def test_a_triax_script_does_not_import_hugging_face_accelerate(tmp_path):
    """Importing Accelerate runs its start-up code and warnings; a script written for triax's
    Accelerator (or Horovod, or Pipe) never asked for it."""
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\nimport torch\nfrom triax import Accelerator\nimport triax.accelerate.utils, triax.horovod, "
        "triax.pipe\naccelerator = Accelerator()\nmodel = accelerator.prepare(torch.nn.Linear(2, 2))\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'accelerate'))\n")
    result = run([sys.executable, str(script)], cwd=str(tmp_path), timeout=240)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


@pytest.mark.parametrize("name", ["DistributedType", "ComputeEnvironment", "SageMakerDistributedType",
                                  "PrecisionType", "LoggerType", "RNGType", "DynamoBackend",
                                  "DDPCommunicationHookType"])
def test_accelerate_enums_print_as_accelerates(name):
    accelerate_dataclasses = pytest.importorskip("accelerate.utils.dataclasses")
    from triax.accelerate.utils import dataclasses

    ours, theirs = getattr(dataclasses, name), getattr(accelerate_dataclasses, name)
    shown = [(str(member), f"{member}", repr(member)) for member in ours]
    assert shown == [(str(member), f"{member}", repr(member)) for member in theirs if member.name in ours.__members__]


@pytest.mark.multiprocess
def test_the_accelerators_type_and_device_print_as_accelerates_on_several_cpu_processes(tmp_path):
    """What Accelerate 1.x prints for a process of a job on CPUs: `DistributedType.MULTI_CPU`
    (a plain str Enum) and `cpu:0` (its device is cpu:<local index modulo torch.cpu.device_count()>)."""
    script = tmp_path / "show.py"
    script.write_text("import torch\nfrom triax import Accelerator\naccelerator = Accelerator()\n"
                      "model = accelerator.prepare(torch.nn.Linear(2, 2))\n"
                      "print(f'{accelerator.distributed_type} {accelerator.device} {next(model.parameters()).device}')\n")
    result = launch(2, [str(script)], cwd=str(tmp_path))
    assert result.stdout.splitlines().count("DistributedType.MULTI_CPU cpu:0 cpu") == 2, result.stdout


def test_a_llama_checkpoint_without_its_tokenizer_is_told_to_bring_its_own(tmp_path, tiny_corpus):
    from support.llama_checkpoints import save_checkpoint

    from triax.config import compose_config
    from triax.train.trainer import Trainer

    save_checkpoint(tmp_path / "llama", "llama")  # no corpus: no tokenizer.json
    config = compose_config(tiny_overrides(tmp_path / "run", tiny_corpus, **{"model.init_from": tmp_path / "llama"}))
    with pytest.raises(ConfigError, match=r"put the llama model's own tokenizer.json \(its tokenizer's save_pretrained "
                                         r"writes it\) there") as error:
        Trainer(config)
    assert "GPT-2" not in str(error.value)


@pytest.mark.multiprocess
def test_shape_keys_beside_init_from_are_named_as_ignored(tmp_path, tiny_corpus):
    from support.llama_checkpoints import save_checkpoint

    save_checkpoint(tmp_path / "llama", "llama", corpus=tiny_corpus)  # 2 layers, 32 wide
    result = train(tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "model.init_from": tmp_path / "llama", "model.n_layer": 3, "model.n_embd": 32, "trainer.max_steps": 1}))
    warning = [line for line in result.stderr.splitlines() if "ignored" in line]
    assert warning == [f"triax: warning: model.n_layer=3, model.n_head=2 ignored: model.init_from="
                       f"'{tmp_path / 'llama'}' decides the model's shape (n_layer=2, n_head=4); leave the shape keys "
                       "out beside model.init_from"], result.stderr  # n_embd=32 is the checkpoint's: no word


@pytest.mark.multiprocess
def test_a_tensor_parallel_run_says_once_why_it_prints_no_sample_and_a_new_llama_is_named_as_one(tmp_path,
                                                                                                  tiny_corpus):
    result = train(tiny_overrides(tmp_path / "run", tiny_corpus, **{
        "model.arch": "llama", "model.n_kv_head": 2, "parallel.tp": 2, "parallel.dp_replicate": 1,
        "trainer.max_steps": 4, "trainer.eval_every": 2, "trainer.eval_batches": 1, "trainer.sample_tokens": 8}),
        nproc=2)
    first = result.stdout.splitlines()[0]
    assert first.startswith("training gpt-micro with model.arch=llama, model.n_layer=2, model.n_head=2, "
                            "model.n_embd=32, model.n_kv_head=2 (llama, "), first
    said = [line for line in result.stdout.splitlines() if line.startswith("no text sample")]
    assert said == [f"no text sample during this run: generating token by token needs the whole model and all "
                    f"its logits on one rank, which this layout (tp=2) splits; `triax generate {tmp_path / 'run'}` "
                    "samples from it afterwards"], result.stdout


def test_triax_config_with_piped_answers_puts_each_question_on_its_line(tmp_path):
    env = dict(quiet_env(), HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "triax", "config", "--config-file", str(tmp_path / "launch.yaml")],
                          input="\n2\n" + "\n" * 20, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "How many machines (nodes)? [1]: " and lines[-1].startswith("configuration written to")
    assert all(line.count("? [") == 1 for line in lines[:-1]), lines  # one question a line, with its answer
    assert "How many processes per machine? [1]: " in lines or any(line.endswith("]: 2") for line in lines)


@pytest.mark.parametrize("page", ["docs/configuration.md", "docs/train.md"])
def test_the_pages_list_every_model_preset(page):
    from triax.models.config import PRESETS

    text = (ROOT / page).read_text()
    assert [name for name in PRESETS if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)] == []


def test_triax_plan_counts_one_device_in_the_singular(capsys):
    assert triax_main(["plan", "--model", "gpt-nano", "--world", "1", "--memory-gb", "8", "--global-batch", "4",
                       "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "1 device x 8 GiB" in out and "1 devices" not in out, out
