"""Validation measures the split: every target token of it counted once with eval_batches=0, the
same windows in every layout and process count, and a loss equal to an independent per-token one."""

import json

import pytest
import torch
import torch.nn.functional as F

from triax.data.text import load_char_datasets
from triax.train.config import compose_config
from triax.train.evaluation import chosen_windows, rank_batches, tiled_windows
from triax.train.trainer import Trainer

from helpers import tiny_overrides, train


@pytest.mark.parametrize("num_windows", [1, 2, 5, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_tiling_counts_every_target_once(num_windows, block):
    counted = []
    for start, skip in tiled_windows(num_windows, block):
        assert 0 <= start < num_windows and 0 <= skip < block
        counted += list(range(start + 1 + skip, start + block + 1))
    assert sorted(counted) == list(range(1, num_windows + block))  # targets 1 .. last token, once each


def test_limited_evaluation_spreads_over_the_split_and_ranks_share_it_exactly():
    windows = chosen_windows(10_000, 64, eval_batches=5, batch_size=4)
    starts = [start for start, _ in windows]
    assert len(windows) == 20 and starts == sorted(starts)
    assert starts[0] == 0 and starts[-1] > 0.9 * 10_000  # the whole split, not its first 300 tokens
    for dp in (1, 2, 3):
        shares = [rank_batches(windows, dp, rank, 4, 64) for rank in range(dp)]
        assert len({len(share) for share in shares}) == 1  # same number of forward passes everywhere
        real = [w for share in shares for batch in share for w in batch if w[1] < 64]
        assert sorted(real) == sorted(windows)


def test_whole_split_loss_equals_a_per_token_reference(tmp_path, tiny_corpus):
    config = compose_config(tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.eval_batches": 0}))
    trainer = Trainer(config)
    trainer.logger.enabled = False
    trainer.train_step()
    result = trainer.evaluate()
    # Reference, target by target: the window of 16 tokens that holds the target (blocks of 16 from the
    # start, the last window ending at the split's end), one cross-entropy per target.
    _, val, _ = load_char_datasets(tiny_corpus, 16)
    ids = val.ids.long()
    model = trainer.raw_model.eval()
    losses = []
    with torch.no_grad():
        for target in range(1, len(ids)):
            start = (target - 1) // 16 * 16 if target <= (len(ids) - 1) // 16 * 16 else len(ids) - 17
            context = ids[start:start + 16]
            logits = model(context[None])[0, target - 1 - start]
            losses.append(F.cross_entropy(logits[None], ids[target][None]).item())
    assert result["val_tokens"] == len(ids) - 1
    assert result["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


@pytest.mark.multiprocess
def test_two_processes_evaluate_the_same_tokens_as_one(tmp_path, tiny_corpus):
    extra = {"trainer.eval_every": 6, "trainer.eval_batches": 3}
    train(tiny_overrides(tmp_path / "ddp", tiny_corpus, **{"trainer.batch_size": 4}, **extra), nproc=2)
    train(tiny_overrides(tmp_path / "single", tiny_corpus, **{"trainer.batch_size": 8}, **extra), nproc=1)

    def last_eval(run):
        records = [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")]
        return [r for r in records if "val_loss" in r][-1]

    ddp, single = last_eval("ddp"), last_eval("single")
    # the same global batch (2 x 4 and 1 x 8): the same windows, so the same tokens and loss
    assert ddp["val_tokens"] == single["val_tokens"] == 24 * 16  # 3 global batches of 8 windows
    assert ddp["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)
