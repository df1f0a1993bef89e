"""Data parallelism and gradient accumulation change how a batch is computed, never the result."""

import json
import os

import torch

from helpers import assert_same_weights, final_weights, tiny_overrides, train


def test_two_processes_equal_one_process_with_double_batch(tmp_path, tiny_corpus):
    # 2 processes x batch 4 must take the same steps as 1 process x batch 8: proof that DDP
    # averages gradients over the global batch rather than training two models.
    train(tiny_overrides(tmp_path / "ddp", tiny_corpus, **{"trainer.batch_size": 4}), nproc=2)
    train(tiny_overrides(tmp_path / "single", tiny_corpus, **{"trainer.batch_size": 8}), nproc=1)
    ddp, single = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "single")
    assert_same_weights(ddp, single)
    # And training actually moved the weights (so the comparison is not of two untouched inits).
    train(tiny_overrides(tmp_path / "short", tiny_corpus, **{"trainer.max_steps": 1}), nproc=1)
    moved = final_weights(tmp_path / "short")
    assert not torch.allclose(moved["lm_head.weight"], single["lm_head.weight"])


def test_grad_accumulation_equals_large_batch(tmp_path, tiny_corpus):
    train(tiny_overrides(tmp_path / "accum", tiny_corpus,
                         **{"trainer.batch_size": 4, "trainer.grad_accum": 2}))
    train(tiny_overrides(tmp_path / "big", tiny_corpus, **{"trainer.batch_size": 8}))
    assert_same_weights(final_weights(tmp_path / "accum"), final_weights(tmp_path / "big"))


def test_metrics_jsonl_records_steps_and_eval(tmp_path, tiny_corpus):
    train(tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.eval_every": 3}))
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] == 6
    assert any("val_loss" in r for r in records)
    assert all({"loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= r.keys() for r in records if r["step"] % 2 == 0)
    assert os.listdir(tmp_path / "run" / "tensorboard")


def test_epoch_based_run_covers_one_epoch(tmp_path, tiny_corpus):
    # max_steps=null: the run length is one pass over the (truncated) training text.
    run_dir = tmp_path / "epochs"
    train(tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": "null", "trainer.max_epochs": 1,
                                                  "data.truncate": 0.02, "trainer.log_every": 1000}))
    text_length = len(open(tiny_corpus).read())
    train_windows = int(int(text_length * 0.02) * 0.9) - 16
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert records[-1]["step"] == train_windows // 8
    assert records[-1]["epoch"] == 0
