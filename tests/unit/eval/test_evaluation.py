"""Validation scores the split, each token once, the same in every layout (triax.data.windows);
the trainer's val_loss equals an independent transformers evaluation of its export."""

import json
import math

import pytest
import torch

from support.helpers import tiny_overrides, train
from support.hf_scoring import char_validation_ids, hf_mean_loss
from triax.data.targets import IGNORE_INDEX
from triax.data.text import CharDataset, Vocabulary
from triax.data.windows import evaluation_windows, mask_unscored, rank_batches


def char_dataset(length, block_size):
    vocab = Vocabulary(list("ab"))
    return CharDataset(torch.arange(length) % 2, block_size, vocab)


def coverage(dataset, plan):
    """How often each token of the split is a scored target."""
    counts = torch.zeros(len(dataset) + dataset.block_size, dtype=torch.long)
    for start, first in zip(plan.starts.tolist(), plan.first_scored.tolist()):
        counts[start + 1 + first:start + 1 + dataset.block_size] += 1
    return counts


@pytest.mark.parametrize("length,block_size", [(100, 8), (97, 8), (17, 16), (18, 16), (1000, 7)])
def test_whole_split_scores_every_target_once(length, block_size):
    dataset = char_dataset(length, block_size)
    counts = coverage(dataset, evaluation_windows(dataset))
    assert counts[0] == 0  # the first token has no context: never a target
    assert counts[1:].tolist() == [1] * (length - 1)


def test_partial_plan_spreads_over_the_split_without_overlap():
    dataset = char_dataset(10_000, 16)
    plan = evaluation_windows(dataset, limit=10)
    assert len(plan) == 10
    counts = coverage(dataset, plan)
    assert counts.max() == 1 and counts.sum() == 160
    assert plan.starts[0] == 0 and plan.starts[-1] > 0.85 * len(dataset)  # reaches the end of the split
    # asking for more windows than the split holds is the whole split
    assert len(evaluation_windows(dataset, limit=10**6)) == len(evaluation_windows(dataset))


@pytest.mark.parametrize("ranks,batch_size", [(1, 8), (2, 4), (3, 5)])
def test_ranks_share_the_plan_exactly(ranks, batch_size):
    dataset = char_dataset(1000, 8)
    plan = evaluation_windows(dataset)
    shares = [list(rank_batches(plan, batch_size, rank, ranks)) for rank in range(ranks)]
    assert len({len(share) for share in shares}) == 1  # the same number of forwards on every rank
    scored = []
    for share in shares:
        for starts, first in share:
            assert len(starts) == batch_size
            _, y = dataset.batch(starts)
            y = mask_unscored(y, first)
            scored += [(int(s), p) for s, row in zip(starts, y) for p in range(8) if row[p] != IGNORE_INDEX]
    expected = [(int(s), p) for s, f in zip(plan.starts, plan.first_scored) for p in range(int(f), 8)]
    assert sorted(scored) == sorted(expected)


def test_trainer_val_loss_equals_transformers_on_the_whole_split(tmp_path, tiny_corpus):
    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{"trainer.eval_every": 6, "trainer.eval_batches": 0}))
    record = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "val_loss" in line][-1]
    from triax.commands.export import main as export_main

    export_main([str(run_dir), str(tmp_path / "hf"), "--format", "hf"])
    ids = char_validation_ids(run_dir, tiny_corpus)
    expected, tokens = hf_mean_loss(str(tmp_path / "hf"), ids, block_size=16)
    assert record["val_tokens"] == tokens == len(ids) - 1
    assert record["val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_corpus):
    """A tiny character run, its export to transformers, and the independent whole-split loss."""
    root = tmp_path_factory.mktemp("evaluated")
    run_dir = root / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{"trainer.eval_every": 6}))
    from triax.commands.export import main as export_main

    export_main([str(run_dir), str(root / "hf"), "--format", "hf"])
    ids = char_validation_ids(run_dir, tiny_corpus)
    expected, tokens = hf_mean_loss(str(root / "hf"), ids, block_size=16)
    return run_dir, root / "hf", ids, expected, tokens


def eval_json(args, nproc=1):
    out = train_output(["-m", "triax", "eval", *map(str, args), "--json"], nproc)
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def train_output(argv, nproc):
    from support.forked import launch

    return launch(nproc, argv, timeout=240).stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [1, 2])
def test_eval_of_a_run_equals_transformers(trained, nproc):
    run_dir, _, ids, expected, tokens = trained
    result = eval_json([run_dir, "--batch-size", 5], nproc)
    assert result["tokens"] == tokens == len(ids) - 1
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert result["bits_per_character"] == pytest.approx(expected / math.log(2), rel=1e-5)


def test_eval_of_a_transformers_directory_on_token_files(trained, tmp_path):
    _, hf_dir, ids, expected, tokens = trained
    path = tmp_path / "val.bin"
    ids.numpy().astype("uint16").tofile(path)
    result = eval_json([hf_dir, "--tokens", path])
    assert result["tokens"] == tokens
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert "bits_per_character" not in result  # ids of unknown characters


def test_eval_refuses_what_is_not_a_model(tmp_path):
    from triax.commands.cli import main

    assert main(["eval", str(tmp_path)]) == 2


def test_eval_of_a_fine_tuned_text_run_uses_its_tokenizer(tmp_path, tiny_corpus):
    """A run started from GPT-2 weights (model.init_from) on text trains on the checkpoint's BPE
    tokens: `triax eval` scores the same tokens, not the characters, so it reports the trainer's
    own last evaluation (same windows, fp32: equal but for the order of the sums)."""
    from support.gpt2_checkpoints import build_gpt2

    build_gpt2(tmp_path / "gpt2", tiny_corpus, tie=False)
    run_dir = tmp_path / "run"
    train(tiny_overrides(run_dir, tiny_corpus, **{"model.init_from": tmp_path / "gpt2", "trainer.max_steps": 2,
                                                   "trainer.eval_every": 2, "trainer.eval_batches": 0}))
    record = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "val_loss" in line][-1]
    result = eval_json([run_dir])
    assert result["tokens"] == record["val_tokens"]
    assert result["loss"] == pytest.approx(record["val_loss"], rel=1e-5)
    assert "bits_per_character" not in result  # a token is not a character
