"""`triax train` with data.task=grpo on a tiny Llama: TRL's figures in metrics.jsonl, a resume after
SIGKILL equal bit for bit to the run that never stopped (a completion's randomness is its place, so
no generator state needs keeping), two data-parallel or tensor-parallel processes and four of
FSDP x TP equal to one, num_iterations > 1 (and its resume), full fine-tuning with a frozen
reference, and what GRPO cannot run refused in one line."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from support.chat_files import write_chat_checkpoint
from support.helpers import (assert_adam_close, assert_bitwise_equal, final_weights, kill_after_snapshot_and_resume,
                             train)
from triax.testing import quiet_env

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

STEPS, LR = 4, 5e-3
REWARDS = '''
def multiples_of_three(prompts, completions, completion_ids, **kwargs):
    """Varies within a group (a random model's completions are never right): tokens whose id divides by 3."""
    return [float(sum(1 for token in ids if token % 3 == 0)) for ids in completion_ids]
'''
TRL_FIGURES = ("loss", "grad_norm", "reward", "reward_std", "rewards/multiples_of_three/mean",
               "rewards/multiples_of_three/std", "frac_reward_zero_std", "completions/mean_length",
               "completions/min_length", "completions/max_length", "completions/clipped_ratio", "entropy",
               "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo-train")
    write_chat_checkpoint(root / "base")
    (root / "rewards.py").write_text(REWARDS)
    words = ["zero", "one", "two", "three", "four"]
    with open(root / "prompts.jsonl", "w") as handle:
        for number in range(40):
            a, b = number % 5, (number // 5) % 5
            handle.write(json.dumps({"prompt": [{"role": "user", "content": f"{words[a]} plus {words[b]}?"}],
                                     "answer": words[a]}) + "\n")
    return root


def overrides(root, run_dir, **extra):
    values = {"model.init_from": root / "base", "data.task": "grpo", "data.path": root / "prompts.jsonl",
              "data.block_size": 64, "grpo.num_generations": 4, "grpo.max_completion_length": 6,
              "grpo.reward_funcs": f"[{root / 'rewards.py'}:multiples_of_three]", "model.lora.rank": 4,
              "model.lora.alpha": 8, "model.lora.targets": "[all-linear]", "trainer.batch_size": 2,
              "trainer.grad_accum": 2, "trainer.max_steps": STEPS, "trainer.log_every": 1,
              "trainer.eval_every": STEPS, "trainer.run_dir": run_dir, "optim.lr": LR, "optim.warmup_steps": 0,
              "parallel.dp_replicate": 1, **extra}
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def single(tmp_path_factory, setup):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train(overrides(setup, run_dir, **{"trainer.save_every": 2, "grpo.completion_log": run_dir / "completions"}),
          timeout=300)
    return run_dir


def test_the_completion_log_holds_every_completion_with_its_reward(single):
    lines = [json.loads(line) for line in open(single / "completions.rank0")]
    assert len(lines) == STEPS * 2 * 2 * 4  # steps x prompts x micro-batches x generations
    assert [line["step"] for line in lines[::16]] == [1, 2, 3, 4]
    for line in lines:
        assert line["rewards"] == [float(sum(1 for token in line["completion_ids"] if token % 3 == 0))]
        assert line["record"].startswith(str(single.parent.parent)) or ":" in line["record"]
    group = lines[:4]
    mean = sum(line["rewards"][0] for line in group) / 4
    assert all((line["advantage"] > 0) == (line["rewards"][0] > mean) for line in group if line["rewards"][0] != mean)


def test_the_log_holds_trls_figures_and_the_updates_are_real(single):
    records = [json.loads(line) for line in open(single / "metrics.jsonl")]
    steps = [record for record in records if "loss" in record]
    assert len(steps) == STEPS
    for record in steps:
        assert set(TRL_FIGURES) <= set(record), sorted(set(TRL_FIGURES) - set(record))
        assert record["completions/max_length"] <= 6
    assert all(record["grad_norm"] > 0 for record in steps)
    validation = [record for record in records if "val_reward" in record][-1]
    assert validation["val_completions"] == 4 * 4 and 0 <= validation["val_pass_rate"] <= 1


def test_resume_after_sigkill_is_bitwise(tmp_path, setup, single):
    """Killed after the snapshot of step 2, started again: the adapters equal the uninterrupted run's."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "triax", "train", *overrides(setup, run_dir, **{"trainer.save_every": 2})]
    kill_after_snapshot_and_resume(command, run_dir)
    assert_bitwise_equal(final_weights(run_dir), final_weights(single))


def test_num_iterations_reuses_each_generated_batch_and_resumes_bitwise(tmp_path, setup):
    """grpo.num_iterations=2: steps 1 and 3 generate (the completion log), 2 and 4 train on their batch
    again; killed after the snapshot of step 2 and started again, the run ends where one that never
    stopped ends."""
    extra = {"grpo.num_iterations": 2, "trainer.save_every": 2}
    whole = tmp_path / "whole"
    train(overrides(setup, whole, **extra, **{"grpo.completion_log": whole / "completions"}), timeout=300)
    lines = [json.loads(line) for line in open(whole / "completions.rank0")]
    assert sorted({line["step"] for line in lines}) == [1, 3] and len(lines) == 2 * 2 * 2 * 4
    steps = [json.loads(line) for line in open(whole / "metrics.jsonl") if '"loss"' in line]
    assert ["reward" in record for record in steps] == [True, False, True, False]
    assert all(record["grad_norm"] > 0 for record in steps)
    resumed = tmp_path / "resumed"
    kill_after_snapshot_and_resume([sys.executable, "-m", "triax", "train", *overrides(setup, resumed, **extra)],
                                   resumed)
    assert_bitwise_equal(final_weights(resumed), final_weights(whole))


@pytest.mark.parametrize("layout", ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2",
                                    "parallel.dp_replicate=2 parallel.tp=2"])
def test_two_data_parallel_processes_equal_one(tmp_path, setup, single, layout):
    """Each rank samples its own prompts' completions (the same as one process samples: their places
    are the same), and the mean of the ranks' gradients is the one-process step's; tensor-parallel
    ranks sample and score the same prompts with half the heads and half the vocabulary each (alone,
    or inside two replicas: four processes)."""
    sizes = {"parallel.dp_replicate": 1, **{key: int(value) for key, value in
                                           (item.split("=") for item in layout.split())}}
    run_dir = tmp_path / "run"
    # The one-process run's two prompts a micro-batch, over the data-parallel ranks (tensor-parallel ones share theirs).
    batch = 2 // (sizes["parallel.dp_replicate"] * sizes.get("parallel.dp_shard", 1))
    train(overrides(setup, run_dir, **{"trainer.save_every": 2, "trainer.batch_size": batch, **sizes}),
          nproc=math.prod(sizes.values()), timeout=300)
    ours = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    theirs = [json.loads(line) for line in open(single / "metrics.jsonl")]
    for mine, other in zip(ours, theirs):
        if "loss" in other:
            assert mine["completions/mean_length"] == other["completions/mean_length"], (mine, other)
            assert mine["reward"] == other["reward"]
            assert abs(mine["grad_norm"] - other["grad_norm"]) <= 1e-5, (mine, other)
    assert_adam_close(final_weights(run_dir), final_weights(single), [LR] * STEPS)


def test_full_fine_tuning_with_a_frozen_reference(tmp_path, setup):
    run_dir = tmp_path / "run"
    train(overrides(setup, run_dir, **{"model.lora.rank": 0, "grpo.beta": 0.1, "trainer.max_steps": 2,
                                       "trainer.eval_every": 0}), timeout=300)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "loss" in line]
    assert records[0]["kl"] == 0 and records[1]["kl"] > 0  # the policy leaves its reference


def completions(run_dir):
    """Every rank's completion log, in (step, prompt, generation) order."""
    lines = [json.loads(line) for path in sorted(run_dir.glob("completions.rank*")) for line in open(path)]
    return sorted(lines, key=lambda line: (line["step"], line["sample"], line["generation"]))


# Four prompts a step: two on each data-parallel rank of FSDP x TP, so its rows too are of several prompts.
FULL = {"model.lora.rank": 0, "grpo.beta": 0.1, "trainer.max_steps": 3, "trainer.eval_every": 0,
        "trainer.grad_accum": 1, "trainer.batch_size": 4}


@pytest.fixture(scope="module")
def full_single(tmp_path_factory, setup):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    train(overrides(setup, run_dir, **FULL, **{"grpo.completion_log": run_dir / "completions"}), timeout=300)
    return run_dir


@pytest.mark.parametrize("layout, processes", [({"parallel.tp": 2}, 2),
                                               ({"parallel.dp_shard": 2, "parallel.tp": 2}, 4)])
def test_tensor_parallel_full_fine_tuning_with_a_reference_equals_one_process(tmp_path, setup, full_single, layout,
                                                                              processes):
    """Every weight trained, beta > 0: the frozen reference is sharded as the policy; TP x 2, alone or
    inside FSDP x 2, samples the one-process run's completions, logs its KL and gradient norms and ends
    with its weights."""
    run_dir = tmp_path / "run"
    batch = 4 // layout.get("parallel.dp_shard", 1)  # the one-process run's prompts, over the dp ranks
    train(overrides(setup, run_dir, **{**FULL, "trainer.batch_size": batch}, **layout,
                    **{"grpo.completion_log": run_dir / "completions"}), nproc=processes, timeout=300)
    assert completions(run_dir) == completions(full_single)  # each prompt logged once, by its data-parallel rank
    ours, theirs = ([json.loads(line) for line in open(run / "metrics.jsonl") if '"loss"' in line]
                    for run in (run_dir, full_single))
    assert len(ours) == len(theirs) == 3 and theirs[-1]["kl"] > 0
    for mine, other in zip(ours, theirs):
        assert mine["reward"] == other["reward"]
        assert abs(mine["kl"] - other["kl"]) <= 1e-6 and abs(mine["grad_norm"] - other["grad_norm"]) <= 1e-5
    sharded, whole = final_weights(run_dir), final_weights(full_single)
    # tp pads the vocabulary to a multiple of its size: the padding's rows are not the model's
    sharded = {name: tensor[:whole[name].shape[0]] if name in whole else tensor for name, tensor in sharded.items()}
    assert_adam_close(sharded, whole, [LR] * 3)


def test_fsdp_and_tensor_parallel_ranks_sample_completions_that_stop_early_as_one_process(tmp_path, setup):
    """A copy of the checkpoint whose generation_config.json ends a completion at every fifth id:
    completions stop at different lengths, so under dp_shard=2 x tp=2 a rank whose completions all
    ended keeps feeding its peers' forwards until every rank's did, and logs what one process samples.
    (The weights: the test above; here a few elements whose gradient is as small as Adam's eps would
    step by round-off, in any multi-process layout.)"""
    checkpoint = setup / "stopping"
    shutil.copytree(setup / "base", checkpoint, dirs_exist_ok=True)
    vocabulary = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    ends = list(range(2, vocabulary, 5))[:64]  # generation_config.json names at most 64
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    runs = {}
    for name, extra, processes in (("one", {"trainer.batch_size": 4}, 1),
                                   ("2d", {"parallel.dp_shard": 2, "parallel.tp": 2, "trainer.batch_size": 2}, 4)):
        runs[name] = tmp_path / name
        train(overrides(setup, runs[name], **{"model.init_from": checkpoint, "trainer.max_steps": 2,
                                              "trainer.eval_every": 0, "trainer.grad_accum": 1,
                                              "grpo.completion_log": runs[name] / "completions", **extra}),
              nproc=processes, timeout=300)
    ours = completions(runs["2d"])
    assert len({len(line["completion_ids"]) for line in ours}) > 2  # some stopped early, at different lengths
    assert ours == completions(runs["one"])


@pytest.mark.parametrize("key, value, words", [
    ("grpo.reward_funcs", "[]", "grpo.reward_funcs"),
    ("grpo.reward_funcs", "[nowhere.py:score]", "does not exist"),
    ("grpo.num_generations", 1, "grpo.num_generations"),
    ("grpo.loss_type", "ppo", "grpo.loss_type"),
    ("grpo.num_iterations", 3, "a multiple of num_iterations"),  # eval_every 4: a snapshot inside a block
    ("grpo.max_completion_length", 64, "leaves no room for a prompt"),
])
def test_what_grpo_cannot_run_is_one_line(tmp_path, setup, key, value, words):
    processes = 2 if key.startswith("parallel.") else 1
    result = train(overrides(setup, tmp_path / "run", **{key: value}), nproc=processes, check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(set(lines)) == 1 and words in lines[0], result.stderr[-2000:]  # every rank says the same line


def test_eval_reports_the_runs_last_evaluation_and_scores_a_prompt_file(single, setup):
    """`triax eval RUN` samples the validation prompts from the places the run's evaluation did, with
    the same weights: the same reward and pass rate; `--prompts FILE` scores the file's prompts."""
    env = quiet_env(PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "triax", "eval", str(single), "--json"], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads(result.stdout)
    last = [json.loads(line) for line in open(single / "metrics.jsonl") if "val_reward" in line][-1]
    assert ours["completions"] == last["val_completions"] == 16
    assert abs(ours["reward"] - last["val_reward"]) < 1e-9 and abs(ours["pass_rate"] - last["val_pass_rate"]) < 1e-9
    result = subprocess.run([sys.executable, "-m", "triax", "eval", str(single), "--prompts",
                             str(setup / "prompts.jsonl")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prompts.jsonl: 160 completions, mean reward" in result.stdout
