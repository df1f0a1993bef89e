"""Weighted mixtures of token sources (data.sources), blended as Megatron's BlendedDataset: the share
of each source follows its weight at every prefix; a run killed with SIGKILL and resumed equals one
that never stopped, bitwise; 2 processes with FSDP read the same samples as one; each source is
validated on its own; bad weights and a source shorter than a window are one line each."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from triax.commands.cli import main as triax_main
from triax.config import compose_config
from triax.data.mixture import BlendOrder, BlendedSampler, Mixture, normalised_weights
from triax.data.sources import open_source
from triax.testing import quiet_env
from triax.train.trainer import Trainer

from support.helpers import assert_bitwise_equal, assert_same_training, final_weights, tiny_overrides, train
from support.token_formats import split_documents, write_megatron, write_shard

VOCAB = 61


def tokens(count, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, count).astype(np.uint16)


def write_corpora(directory, web=700, code=(250, 150)):
    """A Megatron dataset ("web") and two llm.c shards ("code"), each with its own validation data."""
    write_megatron(directory / "web", split_documents(tokens(web, 1), seed=1))
    write_megatron(directory / "web_val", split_documents(tokens(200, 2), seed=2))
    write_shard(directory / "code_000001.bin", tokens(code[0], 3))
    write_shard(directory / "code_000002.bin", tokens(code[1], 4))
    write_shard(directory / "code_val_000001.bin", tokens(150, 5))
    return directory


@pytest.fixture
def corpora(tmp_path):
    return write_corpora(tmp_path)


def sources_override(directory, web=0.7, code=0.3):
    return (f"[{{path:'{directory}/web',weight:{web},val_path:'{directory}/web_val'}},"
            f"{{path:'{directory}/code_00000*.bin',weight:{code},val_path:'{directory}/code_val_*.bin',name:code}}]")


def mixture_overrides(run_dir, directory, **extra):
    values = {"data.task": "tokens", "data.vocab_size": VOCAB, "data.sources": sources_override(directory),
              "model.dropout": 0.1, **extra}
    overrides = tiny_overrides(run_dir, "null", **values)
    return [item for item in overrides if item != "data.path=null"]


def opened(directory, block_size=16):
    web = open_source(f"{directory}/web", f"{directory}/web_val", block_size, VOCAB, None, 0.9)
    code = open_source(f"{directory}/code_00000*.bin", f"{directory}/code_val_*.bin", block_size, VOCAB, None, 0.9)
    return web, code


@pytest.mark.parametrize("shuffle", [True, False])
def test_shares_follow_the_weights_at_every_prefix(tmp_path, shuffle):
    write_megatron(tmp_path / "web", split_documents(tokens(1600, 1), seed=1))
    write_shard(tmp_path / "code_000001.bin", tokens(700, 3))
    web = open_source(f"{tmp_path}/web", None, 4, VOCAB, None, 0.9)
    code = open_source(f"{tmp_path}/code_*.bin", None, 4, VOCAB, None, 0.9)
    mixture = Mixture([web.train, code.train], [0.7, 0.3], ["web", "code"])
    ids = BlendedSampler(mixture, seed=7, shuffle=shuffle).positions(0, 0, 2000).numpy()
    assert len(mixture) >= 2000
    from_web = ids < len(web.train)
    prefix_share = np.cumsum(from_web) / np.arange(1, len(ids) + 1)
    assert abs(prefix_share[-1] - 0.7) <= 0.01
    assert np.abs(prefix_share[99::100] - 0.7).max() <= 0.02
    # Within an epoch no window is drawn twice; each source's windows come in its own order.
    assert len(set(ids.tolist())) == len(ids)
    web_windows = ids[from_web]
    assert (np.all(np.diff(web_windows) > 0)) == (not shuffle)


def test_the_blend_is_megatrons_and_stays_within_a_sample_or_two_of_every_share():
    """Two sources: the two errors w_s * i - n_s sum to 0 (for i >= 1), so the blend takes the one
    that is behind and no source is ever a whole sample off its share. More sources: within 2
    samples in every case here. Each source's samples are numbered in the order it gives them."""
    rng = np.random.default_rng(0)
    for count in [2] * 30 + list(rng.integers(3, 9, 30)):
        weights = normalised_weights(list(rng.random(count) ** 3 + 1e-3), [str(i) for i in range(count)])
        sources, drawn = BlendOrder(weights).at(0, 1500)
        given = np.stack([np.cumsum(sources == source) for source in range(count)], axis=1)
        off = np.abs(given - weights * np.arange(1, 1501)[:, None]).max()
        assert off < (1 if count == 2 else 2), (weights, off)
        for source in range(count):
            assert np.array_equal(drawn[sources == source], np.arange(given[-1, source]))
    # Megatron's tie rule: sample 0 weighs like sample 1, and the first source wins a tie.
    assert BlendOrder(normalised_weights([1, 1], ["a", "b"])).at(0, 4)[0].tolist() == [0, 1, 0, 1]


def test_the_order_depends_on_the_position_alone(corpora):
    web, code = opened(corpora)
    mixture = Mixture([web.train, code.train], [2.0, 1.0], ["web", "code"])
    whole = BlendedSampler(mixture, seed=3).positions(1, 0, 600)
    # A fresh sampler asked for a later slice (a resume, another rank) computes the same samples.
    assert torch.equal(BlendedSampler(mixture, seed=3).positions(1, 450, 150), whole[450:])
    assert not torch.equal(BlendedSampler(mixture, seed=3).positions(2, 0, 600), whole)  # epochs reshuffle
    x, y = mixture.batch(whole[:5])
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_val_loss_is_each_source_and_their_weighted_mean(tmp_path, corpora, capsys):
    Trainer(compose_config(mixture_overrides(tmp_path / "run", corpora, **{
        "trainer.max_steps": 2, "trainer.eval_every": 2, "trainer.eval_batches": 0}))).fit()
    record = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert math.isclose(record["val_loss"], 0.7 * record["val_loss/web"] + 0.3 * record["val_loss/code"],
                        rel_tol=1e-12)
    assert record["val_tokens"] == (200 - 1) + (150 - 1)  # every target of both validation splits
    # `triax eval RUN` scores every source's validation split, summed (as it sums several files).
    assert triax_main(["eval", str(tmp_path / "run"), "--json"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["data"] == ["val split of web", "val split of code"] and scored["tokens"] == record["val_tokens"]


def last_step(log):
    try:
        lines = open(f"{log}.rank0").read().splitlines()
    except FileNotFoundError:
        return 0
    return int(lines[-1].split()[0]) if lines else 0


def losses(run_dir):
    return {record["step"]: record["loss"] for record in map(json.loads, open(run_dir / "metrics.jsonl"))
            if "loss" in record}


@pytest.mark.multiprocess
def test_sigkill_mid_run_and_resume_equals_the_uninterrupted_run_bitwise(tmp_path):
    # 134 web windows / 0.7: an epoch of 191 samples, 47 steps: the resumed run crosses into the
    # second epoch (each source reshuffled).
    corpora = write_corpora(tmp_path, web=150, code=(60, 40))
    steps = 60
    settings = {"trainer.max_steps": steps, "trainer.save_every": 4, "trainer.log_every": 1,
                "trainer.batch_size": 4}
    whole = Trainer(compose_config(mixture_overrides(tmp_path / "whole", corpora, **settings)))
    whole.fit()
    assert whole.steps_per_epoch == 47 and whole.epoch == 1
    run_dir, log = tmp_path / "killed", tmp_path / "samples"
    command = [sys.executable, "-m", "triax", "train", *mixture_overrides(run_dir, corpora, **settings)]
    job = subprocess.Popen([*command, f"debug.sample_log={log}"], env=quiet_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while last_step(log) < 26 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert job.poll() is None, "the run ended before it could be killed"
        os.killpg(job.pid, signal.SIGKILL)
    finally:
        job.wait()
    assert last_step(log) < steps
    result = subprocess.run(command, capture_output=True, text=True, env=quiet_env(), timeout=300)
    assert result.returncode == 0 and "resuming from" in result.stdout, result.stderr[-2000:]
    assert_bitwise_equal(final_weights(run_dir), final_weights(tmp_path / "whole"))
    assert losses(run_dir) == losses(tmp_path / "whole")


def read_sample_log(prefix, world):
    steps = {}
    for rank in range(world):
        for line in open(f"{prefix}.rank{rank}"):
            step, _epoch, *ids = map(int, line.split())
            steps.setdefault(step, []).extend(ids)
    return {step: sorted(ids) for step, ids in steps.items()}


@pytest.mark.multiprocess
def test_two_fsdp_processes_read_the_same_samples_as_one(tmp_path, corpora):
    same = {"model.dropout": 0.0, "model.bias": "false", "trainer.max_steps": 4}
    train(mixture_overrides(tmp_path / "fsdp", corpora, **{
        **same, "parallel.dp_shard": 2, "trainer.batch_size": 4, "debug.sample_log": tmp_path / "fsdp"}), nproc=2)
    Trainer(compose_config(mixture_overrides(tmp_path / "single", corpora, **{
        **same, "trainer.batch_size": 8, "debug.sample_log": tmp_path / "single"}))).fit()
    assert read_sample_log(tmp_path / "fsdp", 2) == read_sample_log(tmp_path / "single", 1)
    assert_same_training(tmp_path / "fsdp", tmp_path / "single")


@pytest.mark.parametrize("web, says", [
    ("0", "data.sources.0.weight=0.0 is invalid; use a positive number"),
    ("-0.5", "data.sources.0.weight=-0.5 is invalid"),
    ("nan", "data.sources.0.weight=nan is invalid"),
])
def test_a_weight_of_zero_negative_or_nan_is_one_line(tmp_path, corpora, capsys, web, says):
    overrides = mixture_overrides(tmp_path / "run", corpora, **{"data.sources": sources_override(corpora, web=web)})
    assert triax_main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_mixture_settings_that_cannot_work_are_one_line(tmp_path, corpora, capsys):
    write_shard(tmp_path / "tiny_000001.bin", tokens(10, 6))
    short = f"[{{path:'{tmp_path}/tiny_*.bin',weight:1,val_path:'{corpora}/code_val_*.bin'}}]"
    cases = [({"data.sources": short}, "tiny_*.bin' holds 10 tokens, too few for one window"),
             ({"data.path": str(corpora / "web")}, "give either data.path (one source) or data.sources"),
             ({"data.sources": f"[{{path:'{corpora}/web'}},{{path:'{corpora}/web'}}]"}, "a name of its own"),
             ({"data.sources": f"[{{path:'{corpora}/web',wieght:1}}]"}, "data.sources.wieght"),
             ({"data.task": "char"}, "data.sources (a mixture) is for data.task=tokens"),
             # a source's name becomes a metric's name: no '/' (it would nest in TensorBoard), not empty
             ({"data.sources": f"[{{path:'{corpora}/web',name:'a/b'}}]"}, "data.sources.0.name='a/b' is invalid"),
             ({"data.sources": f"[{{path:'{corpora}/web',name:''}}]"}, "data.sources.0.name='' is invalid"),
             # a source's paths are named as the source's keys, not as data.path
             ({"data.sources": f"[{{path:'{corpora}/web'}},{{path:'{tmp_path}/nope',name:x}}]"},
              f"data.sources.1.path '{tmp_path}/nope' does not exist"),
             ({"data.sources": f"[{{path:'{corpora}/code_train_*.bin',val_path:'{tmp_path}/nope_*.bin'}}]"},
              "matches no file")]
    for extra, says in cases:
        assert triax_main(["train", *mixture_overrides(tmp_path / "run", corpora, **extra)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, (extra, err)
