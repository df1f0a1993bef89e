"""A run transformers' Trainer began (a real Trainer, tiny GPT-2 and Llama models on the CPU),
continued by `triax train trainer.continue_from=out/checkpoint-N` (triax/checkpoint/hf_trainer_run.py):
the first step triax takes equals the step the Trainer's own resume_from_checkpoint takes, from the
same weights, AdamW state, step count and learning rate; damaged or hostile files are refused in
one line.

The data is one fixed batch: a training set of exactly per_device_train_batch_size samples, the
windows triax's token data cuts from the same token file (every batch holds both, in some order,
which only reorders the loss's sum).
"""

import json

import numpy as np
import pytest
import torch

from helpers import adam_tolerance, train
from test_nanogpt_checkpoint import Payload
from triax.checkpoint.pickled import pickled_bytes

transformers = pytest.importorskip("transformers")

VOCAB, BLOCK, STOP, MAX_STEPS, WARMUP, LR = 64, 16, 2, 4, 1, 1e-2


def hf_model(kind, tie=True, bias=False):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                         tie_word_embeddings=tie, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                          tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # transformers zero-initialises biases and ones norms: make every tensor distinct
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return model


def arguments(output_dir, **extra):
    values = dict(output_dir=str(output_dir), max_steps=MAX_STEPS, save_steps=STOP, per_device_train_batch_size=2,
                  use_cpu=True, report_to=[], learning_rate=LR, weight_decay=0.1, warmup_steps=WARMUP,
                  logging_steps=1, disable_tqdm=True, seed=0)
    return transformers.TrainingArguments(**{**values, **extra})


def linear_lr(step):
    """transformers' get_linear_schedule_with_warmup at `step`."""
    return LR * (step / WARMUP if step < WARMUP else max(0.0, (MAX_STEPS - step) / (MAX_STEPS - WARMUP)))


class SaveAndStop(transformers.TrainerCallback):
    """Save after the first resumed step and stop (save_steps comes back from trainer_state.json)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == STOP + 1:
            control.should_save = control.should_training_stop = True
        return control


@pytest.fixture(params=["gpt2", "llama"])
def started(request, tmp_path):
    """The Trainer's run stopped at step STOP (its checkpoint-STOP), the token files triax reads the
    same two samples from, and what the Trainer's own resume takes as its next step (loss, weights)."""
    tokens = np.random.default_rng(3).integers(0, VOCAB, BLOCK + 2).astype(np.uint16)
    data = tmp_path / "data"
    data.mkdir()
    tokens.tofile(data / "train.bin")
    tokens.tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "dtype": "uint16"}))
    windows = torch.from_numpy(tokens.astype(np.int64)).unfold(0, BLOCK + 1, 1)  # triax's two samples
    samples = [{"input_ids": window, "labels": window} for window in windows]  # the model shifts the labels
    transformers.Trainer(model=hf_model(request.param), args=arguments(tmp_path / "out"), train_dataset=samples).train()
    folder = tmp_path / "out" / f"checkpoint-{STOP}"
    with torch.no_grad():
        before = transformers.AutoModelForCausalLM.from_pretrained(folder)
        loss = before(input_ids=windows, labels=windows).loss.item()
    # The Trainer's own resume, with the run's own arguments (max_steps sets the schedule's length),
    # saving after its first step and stopping there: its checkpoint-(STOP + 1).
    resumed = transformers.AutoModelForCausalLM.from_pretrained(folder)
    transformers.Trainer(model=resumed, args=arguments(tmp_path / "resumed"), train_dataset=samples,
                         callbacks=[SaveAndStop()]).train(resume_from_checkpoint=str(folder))
    return {"kind": request.param, "folder": folder, "data": data, "loss": loss,
            "before": folder / "model.safetensors", "after": tmp_path / "resumed" / f"checkpoint-{STOP + 1}"}


def continue_overrides(run_dir, started, *extra):
    return [f"trainer.continue_from={started['folder']}", "data.task=tokens", f"data.path={started['data']}",
            f"trainer.run_dir={run_dir}", "trainer.sample_tokens=0", "trainer.eval_every=0",
            f"optim.warmup_steps={WARMUP}", f"data.block_size={BLOCK}", *extra]


@pytest.mark.multiprocess
def test_the_first_step_triax_takes_is_the_trainers_next_step(tmp_path, started):
    """Trainer.train(resume_from_checkpoint=checkpoint-2), whose checkpoint-3 holds the weights
    after the one step triax takes (trainer.max_steps=3; the schedule's length stays the Trainer's 4)."""
    from safetensors.torch import load_file

    from triax.train.commands import export_main

    run_dir = tmp_path / "run"
    result = train(continue_overrides(run_dir, started, f"trainer.max_steps={STOP + 1}"))
    assert f"continuing transformers Trainer's run {started['folder']} at step {STOP}/{STOP + 1}" in result.stdout
    record = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line][-1]
    assert record["step"] == STOP + 1
    assert record["loss"] == pytest.approx(started["loss"], rel=1e-6)
    assert record["lr"] == pytest.approx(linear_lr(STOP + 1), rel=1e-12)  # logged after the step: the next one's
    assert export_main([str(run_dir), str(tmp_path / "export"), "--format", "hf"]) == 0
    ours = load_file(tmp_path / "export" / "model.safetensors")
    atol, rtol = adam_tolerance([linear_lr(STOP)])
    before, expected_all = load_file(started["before"]), load_file(started["after"] / "model.safetensors")
    for name, expected in expected_all.items():
        got, start = ours[name], before[name]
        if name.endswith("attn.c_attn.bias"):
            # The key's bias has no true gradient (softmax ignores a shift shared by every key): its
            # computed gradient is round-off, which AdamW turns into a step of up to about lr.
            key = torch.arange(got.numel()) // (got.numel() // 3) == 1
            assert (got[key] - expected[key]).abs().max() <= 2 * LR
            got, expected, start = got[~key], expected[~key], start[~key]
        # The same arithmetic but for how q, k and v are cut (GPT-2: one fused matmul in
        # transformers, three in triax) and how sums are ordered: round-off, which Adam passes on
        # (helpers.adam_tolerance: lr x 2^-10 here, where the step moved each tensor by about lr;
        # about 1e-7 seen), while a wrong moment, step count or rate moves it by a fraction of lr.
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=name)
        assert (expected - start).abs().max() > 100 * atol  # the step itself is far above the tolerance
