"""model.init_from: a GPT-2 saved by transformers (tiny, random, built here) computes the same
logits in triax, fine-tunes in every layout as in one process, and exports back to transformers."""

import json

import pytest
import torch

from support.gpt2_checkpoints import VOCAB, build_gpt2
from support.helpers import assert_adam_close, final_weights, run_config, tiny_overrides, train


@pytest.mark.parametrize("tie", [True, False])
def test_same_logits_at_step_zero(tmp_path, tiny_corpus, tie):
    from triax.interop.hf.whole_model import load_hf_model

    reference = build_gpt2(tmp_path, tiny_corpus, tie)
    ours = load_hf_model(str(tmp_path), torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def hf_tensors(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tiny_corpus):
    directory = tmp_path_factory.mktemp("gpt2")
    build_gpt2(directory, tiny_corpus, tie=False)
    return directory


def overrides(run_dir, corpus, gpt2_dir, batch_size, **extra):
    return tiny_overrides(run_dir, corpus, **{"model.init_from": str(gpt2_dir), "trainer.max_steps": 3,
                                              "trainer.batch_size": batch_size, "trainer.eval_every": 3,
                                              "trainer.eval_batches": 1, "parallel.dp_replicate": 1, **extra})


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_corpus, gpt2_dir):
    run_dir = tmp_path_factory.mktemp("single")
    train(overrides(run_dir, tiny_corpus, gpt2_dir, 8))
    return run_dir


def test_starts_from_the_checkpoint_and_exports_back(tmp_path, tiny_corpus, gpt2_dir, baseline):
    # One step at a negligible learning rate: the weights are the checkpoint's.
    run_dir = tmp_path / "still"
    train(overrides(run_dir, tiny_corpus, gpt2_dir, 8, **{"trainer.max_steps": 1, "optim.lr": 1e-12,
                                                           "optim.min_lr": 0.0}))
    from triax.commands.export import main as export_main

    export_main([str(run_dir), str(tmp_path / "hf"), "--format", "hf"])
    exported, original = hf_tensors(tmp_path / "hf"), hf_tensors(gpt2_dir)
    for name, tensor in original.items():
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            continue
        assert torch.allclose(exported[name], tensor, atol=1e-6), name
    assert json.load(open(run_dir / "model.json"))["vocab_size"] == VOCAB
    assert (run_dir / "tokenizer.json").read_text() == (gpt2_dir / "tokenizer.json").read_text()
    # The fine-tuned run exports to a directory transformers loads, with the same loss as triax's.
    export_main([str(baseline), str(tmp_path / "tuned"), "--format", "hf"])
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "tuned"), local_files_only=True)
    assert model.config.vocab_size == VOCAB


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,settings", [("fsdp2", {"parallel.dp_shard": 2}), ("tp2", {"parallel.tp": 2})])
def test_fine_tuning_in_a_layout_equals_one_process(name, settings, tmp_path, tiny_corpus, gpt2_dir, baseline):
    batch_size = 4 if "parallel.dp_shard" in settings else 8
    train(overrides(tmp_path, tiny_corpus, gpt2_dir, batch_size, **settings), nproc=2)

    def last(run_dir, key):
        records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        return [r[key] for r in records if key in r][-1]

    for key in ("loss", "val_loss"):
        assert last(tmp_path, key) == pytest.approx(last(baseline, key), rel=1e-5)
    ours, reference = final_weights(tmp_path), final_weights(baseline)
    # tp2 pads the vocabulary to 302 rows: the padding row stays zero, the real rows train as in one process.
    for name in ("tok_emb.weight", "lm_head.weight"):
        assert not ours[name][VOCAB:].any()
        ours[name] = ours[name][:VOCAB]
    learning_rates = [run_config(baseline)["optim"]["lr"]] * 3  # the peak lr: an upper bound
    assert_adam_close(ours, reference, learning_rates)


def test_starts_from_another_run(tmp_path, tiny_corpus, gpt2_dir, baseline):
    run_dir = tmp_path / "again"
    train(tiny_overrides(run_dir, tiny_corpus, **{"model.init_from": str(baseline), "trainer.max_steps": 1,
                                                  "optim.lr": 1e-12, "optim.min_lr": 0.0}))
    ours, started_from = final_weights(run_dir), final_weights(baseline)
    assert ours.keys() == started_from.keys()
    for name in ours:
        assert torch.allclose(ours[name], started_from[name], atol=1e-6), name


def test_a_pickled_checkpoint_is_refused(tmp_path, tiny_corpus):
    from triax.commands.cli import main

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "vocab_size": 10, "n_layer": 1, "n_head": 1, "n_embd": 8, "n_positions": 16}))
    (tmp_path / "ckpt" / "pytorch_model.bin").write_bytes(b"not read")
    assert main(["train", *tiny_overrides(tmp_path / "run", tiny_corpus,
                                          **{"model.init_from": str(tmp_path / "ckpt")})]) == 2
    assert not (tmp_path / "run").exists()
