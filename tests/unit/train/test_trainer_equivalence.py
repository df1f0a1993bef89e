"""Data parallelism and gradient accumulation change how a batch is computed, never the result."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from support.helpers import ZERO_GRADIENT_SUFFIXES, assert_same_training, final_weights, tiny_overrides, train
from triax.models import GPT, GPTConfig


def test_key_bias_gradient_is_zero_by_construction():
    # Why helpers.assert_same_training holds these parameters only to a loose bound: in float64
    # their gradient is zero to round-off, while every other parameter's is not.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)).double()
    with torch.no_grad():  # non-zero biases everywhere, so nothing is zero only by initialisation
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    ids = torch.randint(0, 11, (4, 8))
    F.cross_entropy(model(ids).flatten(0, 1), torch.roll(ids, -1, 1).flatten()).backward()
    zero = [name for name, p in model.named_parameters() if name.endswith(ZERO_GRADIENT_SUFFIXES)]
    assert zero == ["layers.0.attn.k_proj.bias", "layers.1.attn.k_proj.bias"]
    for name, parameter in model.named_parameters():
        largest = parameter.grad.abs().max().item()
        if name in zero:
            assert largest < 1e-14, (name, largest)
        else:
            assert largest > 1e-6, (name, largest)


@pytest.mark.multiprocess
def test_two_processes_equal_one_process_with_double_batch(tmp_path, tiny_corpus):
    # 2 processes x batch 4 must take the same steps as 1 process x batch 8: proof that DDP
    # averages gradients over the global batch rather than training two models.
    train(tiny_overrides(tmp_path / "ddp", tiny_corpus, **{"trainer.batch_size": 4}), nproc=2)
    train(tiny_overrides(tmp_path / "single", tiny_corpus, **{"trainer.batch_size": 8}), nproc=1)
    assert_same_training(tmp_path / "ddp", tmp_path / "single")
    single = final_weights(tmp_path / "single")
    # And training actually moved the weights (so the comparison is not of two untouched inits).
    train(tiny_overrides(tmp_path / "short", tiny_corpus, **{"trainer.max_steps": 1}), nproc=1)
    moved = final_weights(tmp_path / "short")
    assert not torch.allclose(moved["lm_head.weight"], single["lm_head.weight"])


@pytest.mark.multiprocess
def test_grad_accumulation_equals_large_batch(tmp_path, tiny_corpus):
    train(tiny_overrides(tmp_path / "accum", tiny_corpus,
                         **{"trainer.batch_size": 4, "trainer.grad_accum": 2}))
    train(tiny_overrides(tmp_path / "big", tiny_corpus, **{"trainer.batch_size": 8}))
    assert_same_training(tmp_path / "accum", tmp_path / "big")


@pytest.mark.multiprocess
def test_metrics_jsonl_records_steps_and_eval(tmp_path, tiny_corpus):
    train(tiny_overrides(tmp_path / "run", tiny_corpus, **{"trainer.eval_every": 3}))
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] == 6
    assert any("val_loss" in r for r in records)
    assert all({"loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys() for r in records if r["step"] % 2 == 0)
    assert not any("mfu" in r for r in records)  # a CPU has no stated peak unless trainer.peak_flops sets one
    assert os.listdir(tmp_path / "run" / "tensorboard")


@pytest.mark.multiprocess
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
