"""A vocabulary padded for tensor parallelism belongs to the layout, not to the snapshot.

On a corpus of 29 characters tp=1 keeps 29 rows of the embedding and head, tp=2 pads them to 30,
tp=4 to 32. The padding rows are zero, get no gradient and keep zero AdamW moments, so a snapshot
saved with any padding is the same model: a run saved at tp=1 and continued at tp=2 (alone or
under FSDP), or saved at tp=2 and continued at tp=1 or tp=4, lands where the uninterrupted tp=1
run does (to the round-off of a parallel layout, helpers.assert_adam_close), and `triax generate`/`export` read a snapshot
whatever padding the run's model.json was last written with. In one process: the loader moves
the real rows (weights and optimizer moments) between paddings, for every model family, tied or
untied, never reads a snapshot's padding rows (an older one may hold non-zero values there), and
a snapshot of another vocabulary is still refused.
"""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from support.forked import launch
from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train
from triax import checkpoint
from triax.commands.cli import main as triax_main
from triax.models import VOCABULARY_PARAMETERS, GPTConfig, build_model, vocabulary_rows
from triax.testing import quiet_env
from support import SUPPORT_DIR

VOCAB = 29  # distinct characters of the corpus below: odd, so tp=2 and tp=4 pad it differently
STEPS = 3


@pytest.fixture(scope="module")
def odd_corpus(tmp_path_factory, tiny_corpus):
    path = tmp_path_factory.mktemp("odd") / "corpus.txt"
    text = open(tiny_corpus).read()
    path.write_text(text + "!")  # a 29th character
    assert len(set(path.read_text())) == VOCAB
    return str(path)


def settings(run_dir, corpus, **extra):
    # Four heads so that tp=4 splits attention; global batch 8 in every layout (tp does not widen it).
    return tiny_overrides(run_dir, corpus, **{"model.n_head": 4, "trainer.max_steps": STEPS, "trainer.save_every": 1,
                                              "trainer.log_every": 1, "parallel.dp_replicate": 1, **extra})


def continued(source, run_dir, from_step):
    """A copy of run `source` as if it had been stopped after its snapshot of `from_step`."""
    shutil.copytree(source, run_dir)
    for name in os.listdir(run_dir / "snapshots"):
        if checkpoint.snapshot_step(name) > from_step:
            shutil.rmtree(run_dir / "snapshots" / name)
    os.remove(run_dir / "metrics.jsonl")
    return run_dir


def losses(run_dir):
    """{step: training loss} of the steps the run logged."""
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_lands_on(run_dir, baseline, rows, resumed_after):
    """`run_dir` took only the steps after `resumed_after` (it resumed rather than started over),
    and its final snapshot has `rows` rows of vocabulary, its padding zero, and otherwise the
    uninterrupted baseline's weights (to a parallel layout's round-off) and loss."""
    assert sorted(losses(run_dir)) == list(range(resumed_after + 1, STEPS + 1))
    weights = final_weights(run_dir)
    for name in VOCABULARY_PARAMETERS:
        assert weights[name].shape[0] == rows, (name, weights[name].shape)
        assert not weights[name][VOCAB:].any(), f"{name}: its padding rows moved"
        weights[name] = weights[name][:VOCAB]
    assert_adam_close(weights, final_weights(baseline), [run_config(baseline)["optim"]["lr"]] * STEPS)
    assert losses(run_dir)[STEPS] == pytest.approx(losses(baseline)[STEPS], rel=1e-5)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, odd_corpus):
    """The uninterrupted tp=1 run (29 rows), a snapshot every step."""
    run_dir = tmp_path_factory.mktemp("vocab") / "tp1"
    train(settings(run_dir, odd_corpus))
    return run_dir


@pytest.fixture(scope="module")
def tp2_run(baseline, odd_corpus):
    """The baseline stopped after step 1 and continued at tp=2 (30 rows)."""
    run_dir = continued(baseline, baseline.parent / "tp1_then_tp2", 1)
    train(settings(run_dir, odd_corpus, **{"parallel.tp": 2}), nproc=2, timeout=300)
    return run_dir


@pytest.mark.multiprocess
def test_a_tp1_snapshot_continues_at_tp2(baseline, tp2_run):
    assert_lands_on(tp2_run, baseline, rows=30, resumed_after=1)


@pytest.mark.multiprocess
def test_a_tp1_snapshot_continues_as_fsdp_by_tp2(baseline, odd_corpus, tmp_path):
    """FSDP shards each tensor-parallel shard again (15 rows as 8 + 7): the real rows still land."""
    run_dir = continued(baseline, tmp_path / "run", 1)
    train(settings(run_dir, odd_corpus, **{"parallel.dp_shard": 2, "parallel.tp": 2, "trainer.batch_size": 4}),
          nproc=4, timeout=300)
    assert_lands_on(run_dir, baseline, rows=30, resumed_after=1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,rows", [(1, VOCAB), (4, 32)])
def test_a_tp2_snapshot_continues_in_another_padding(tp, rows, baseline, tp2_run, odd_corpus, tmp_path):
    """Saved at step 2 with 30 rows; continued with none (tp=1) or with 32 (tp=4)."""
    run_dir = continued(tp2_run, tmp_path / "run", 2)
    args = settings(run_dir, odd_corpus, **{"parallel.tp": tp})
    if tp == 1:
        train(args)
    else:  # each rank reports the snapshot bytes it read to resume
        probe = os.path.join(SUPPORT_DIR, "snapshot_probe.py")
        result = launch(tp, [probe, *args], env=quiet_env(), timeout=300)
        reports = [json.loads(found) for found in re.findall(r"PROBE (\{[^{}]*\})", result.stdout)]
        assert sorted(r["rank"] for r in reports) == list(range(tp)) and all(r["step"] == 2 for r in reports)
        # Each rank read the saved chunks (one per tp=2 rank) overlapping its own shards' real rows,
        # never the whole snapshot.
        shards = json.load(open(run_dir / "snapshots" / "step_00000002" / "shards.json"))
        total = sum(chunk["bytes"] for entry in shards["tensors"].values() for chunk in entry["chunks"])
        assert all(0 < r["bytes_read"] < total for r in reports), (reports, total)
    assert_lands_on(run_dir, baseline, rows=rows, resumed_after=2)


def export(run_dir, out):
    assert triax_main(["export", str(run_dir), str(out)]) == 0
    return load_file(str(out))


def greedy_text(run_dir, capsys):
    capsys.readouterr()
    assert triax_main(["generate", str(run_dir), "--prompt", "the ", "--tokens", "24", "--greedy"]) == 0
    return capsys.readouterr().out


def set_model_json_padding(run_dir, rows):
    path = run_dir / "model.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), padded_vocab_size=rows)))


@pytest.mark.multiprocess
def test_generate_and_export_read_a_snapshot_with_fewer_rows_than_model_json(baseline, tmp_path, capsys):
    """A run continued at tp=2 that stopped before its first snapshot: model.json says 30 rows,
    the newest snapshot (written at tp=1) has 29."""
    plain = continued(baseline, tmp_path / "plain", 1)
    widened = continued(baseline, tmp_path / "widened", 1)
    set_model_json_padding(widened, 30)
    exported, saved = export(widened, tmp_path / "widened.safetensors"), final_weights(plain)
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    assert greedy_text(widened, capsys) == greedy_text(plain, capsys)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_json_rows", [30, None])
def test_generate_and_export_drop_a_snapshots_padding_whatever_model_json_says(model_json_rows, tp2_run, tmp_path,
                                                                               capsys):
    """The snapshot has 30 rows (tp=2); model.json says so too, or (a run continued at tp=1 that
    stopped before its first snapshot) has no padding. The export has the true 29 either way."""
    run_dir = continued(tp2_run, tmp_path / "run", STEPS)
    set_model_json_padding(run_dir, model_json_rows)
    saved, exported = final_weights(run_dir), export(run_dir, tmp_path / "out.safetensors")
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor[:VOCAB] if name in VOCABULARY_PARAMETERS else tensor), name
    assert greedy_text(run_dir, capsys)


# ---- in one process: the loader itself --------------------------------------------------------

ARCHES = {"gpt2": {}, "llama": {"n_kv_head": 1}, "qwen2": {"n_kv_head": 1}, "mistral": {"n_kv_head": 1}}


def model_and_optimizer(arch, tie, padded, seed):
    config = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=16, arch=arch,
                       tie_embeddings=tie, padded_vocab_size=padded, **ARCHES[arch])
    model = build_model(config, seed=seed)
    return config, model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def trained(arch, tie, padded):
    config, model, optimizer = model_and_optimizer(arch, tie, padded, seed=0)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def state_by_name(model, optimizer):
    """{parameter name: (weight, exp_avg, exp_avg_sq)} (a tied weight under both its names)."""
    return {name: (p.detach(), *(optimizer.state[p][key] for key in ("exp_avg", "exp_avg_sq")))
            for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("arch", list(ARCHES))
@pytest.mark.parametrize("tie", [False, True])
def test_the_loader_moves_real_rows_between_paddings(arch, tie, tmp_path):
    saved_model, saved_optimizer = trained(arch, tie, padded=30)
    saved = state_by_name(saved_model, saved_optimizer)
    for name in VOCABULARY_PARAMETERS:  # the premise: padding rows and their moments stay zero
        assert all(not tensor[VOCAB:].any() for tensor in saved[name]), name
    with torch.no_grad():  # as an older snapshot might hold: non-zero padding, which no logit uses
        saved_model.tok_emb.weight[VOCAB:] = 1.0
    path = checkpoint.save_snapshot(str(tmp_path), 2, saved_model, saved_optimizer, {})
    for padded in (None, 30, 32):
        config, model, optimizer = model_and_optimizer(arch, tie, padded, seed=1)
        checkpoint.load_snapshot(path, model, optimizer, real_rows=vocabulary_rows(config))
        loaded = state_by_name(model, optimizer)
        assert loaded.keys() == saved.keys()
        for name, tensors in loaded.items():
            for mine, theirs in zip(tensors, saved[name]):
                if name in VOCABULARY_PARAMETERS:
                    assert mine.shape[0] == config.vocab_rows and not mine[VOCAB:].any(), name
                    mine, theirs = mine[:VOCAB], theirs[:VOCAB]
                assert torch.equal(mine, theirs), name


def test_a_snapshot_of_another_vocabulary_is_refused(tmp_path):
    """Rows are matched by the real vocabulary, which must be at least the loading model's."""
    model, optimizer = trained("gpt2", False, padded=30)
    path = checkpoint.save_snapshot(str(tmp_path), 1, model, optimizer, {})
    config = GPTConfig(vocab_size=31, block_size=8, n_layer=1, n_head=2, n_embd=16)
    with pytest.raises(checkpoint.SnapshotError, match="does not fit"):
        checkpoint.load_snapshot(path, build_model(config, seed=0), None, real_rows=vocabulary_rows(config))


def test_resuming_on_another_vocabulary_is_refused_before_loading(tmp_path, odd_corpus, tiny_corpus):
    """The rows are matched by token id: a run continued on data of another vocabulary (28
    characters against the snapshot's 29) would read rows that name other tokens."""
    from triax.errors import ConfigError
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    assert triax_main(["train", *tiny_overrides(tmp_path, odd_corpus, **{"trainer.max_steps": 1})]) == 0
    with pytest.raises(ConfigError, match="vocabulary of 29 tokens, this run's has 28"):
        Trainer(compose_config(tiny_overrides(tmp_path, tiny_corpus, **{"trainer.max_steps": 2})))
