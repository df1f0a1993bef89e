"""A run transformers' Trainer began (a real Trainer, tiny GPT-2 and Llama models on the CPU),
continued by `triax train trainer.continue_from=out/checkpoint-N` (triax/interop/hf_trainer/run.py):
the first step triax takes equals the step the Trainer's own resume_from_checkpoint takes, from the
same weights, AdamW state, step count and learning rate; damaged or hostile files are refused in
one line.

The data is one fixed batch: a training set of exactly per_device_train_batch_size samples, the
windows triax's token data cuts from the same token file (every batch holds both, in some order,
which only reorders the loss's sum).
"""

import json
import shutil

import numpy as np
import pytest
import torch

from support.helpers import adam_tolerance, train
from support.nanogpt_checkpoints import Payload
from triax.interop.shared.pickled import pickled_bytes

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


def trainer_run(kind, tmp_path, **extra):
    """The Trainer's run stopped at step STOP (its checkpoint-STOP), the token files triax reads the
    same two samples from, and the batch."""
    tokens = np.random.default_rng(3).integers(0, VOCAB, BLOCK + 2).astype(np.uint16)
    data = tmp_path / "data"
    data.mkdir()
    tokens.tofile(data / "train.bin")
    tokens.tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "dtype": "uint16"}))
    windows = torch.from_numpy(tokens.astype(np.int64)).unfold(0, BLOCK + 1, 1)  # triax's two samples
    samples = [{"input_ids": window, "labels": window} for window in windows]  # the model shifts the labels
    model = hf_model(kind, tie=kind == "gpt2")  # each family's default: GPT-2 ties its head, Llama does not
    transformers.Trainer(model=model, args=arguments(tmp_path / "out", **extra), train_dataset=samples).train()
    return {"kind": kind, "folder": tmp_path / "out" / f"checkpoint-{STOP}", "data": data, "windows": windows,
            "samples": samples}


LAYOUTS = {"gpt2": ("gpt2", []), "llama": ("llama", []),
           # each of two processes takes one of the two samples and holds half of every weight and moment
           "gpt2-fsdp-two-processes": ("gpt2", ["parallel.dp_shard=2", "trainer.batch_size=1"])}


@pytest.fixture(params=list(LAYOUTS))
def started(request, tmp_path):
    """trainer_run, and what the Trainer's own resume takes as its next step (loss, weights)."""
    kind, layout = LAYOUTS[request.param]
    run = trainer_run(kind, tmp_path)
    folder, windows = run["folder"], run["windows"]
    with torch.no_grad():
        before = transformers.AutoModelForCausalLM.from_pretrained(folder)
        loss = before(input_ids=windows, labels=windows).loss.item()
    # The Trainer's own resume, with the run's own arguments (max_steps sets the schedule's length),
    # saving after its first step and stopping there: its checkpoint-(STOP + 1).
    resumed = transformers.AutoModelForCausalLM.from_pretrained(folder)
    transformers.Trainer(model=resumed, args=arguments(tmp_path / "resumed"), train_dataset=run["samples"],
                         callbacks=[SaveAndStop()]).train(resume_from_checkpoint=str(folder))
    return {**run, "loss": loss, "layout": layout, "before": folder / "model.safetensors",
            "after": tmp_path / "resumed" / f"checkpoint-{STOP + 1}"}


@pytest.fixture(scope="module")
def gpt2_trained(tmp_path_factory):
    """One GPT-2 Trainer run for the module: the tests that damage it each work on a copy (gpt2_run)."""
    return trainer_run("gpt2", tmp_path_factory.mktemp("gpt2_run"))


@pytest.fixture
def gpt2_run(gpt2_trained, tmp_path):
    """The GPT-2 Trainer run's checkpoint and token files, copied into the test's own directory."""
    source = gpt2_trained["data"].parent
    for name in ("out", "data"):
        shutil.copytree(source / name, tmp_path / name)
    return dict(gpt2_trained, folder=tmp_path / "out" / f"checkpoint-{STOP}", data=tmp_path / "data")


def continue_overrides(run_dir, started, *extra):
    return [f"trainer.continue_from={started['folder']}", "data.task=tokens", f"data.path={started['data']}",
            f"trainer.run_dir={run_dir}", "trainer.sample_tokens=0", "trainer.eval_every=0",
            f"optim.warmup_steps={WARMUP}", f"data.block_size={BLOCK}", *extra]


@pytest.mark.multiprocess
def test_the_first_step_triax_takes_is_the_trainers_next_step(tmp_path, started):
    """Trainer.train(resume_from_checkpoint=checkpoint-2), whose checkpoint-3 holds the weights
    after the one step triax takes (trainer.max_steps=3; the schedule's length stays the Trainer's 4)."""
    from safetensors.torch import load_file

    from triax.commands.export import main as export_main

    run_dir = tmp_path / "run"
    result = train(continue_overrides(run_dir, started, f"trainer.max_steps={STOP + 1}", *started["layout"]),
                   nproc=2 if started["layout"] else 1)
    assert f"continuing transformers Trainer's run {started['folder']} at step {STOP}/{STOP + 1}" in result.stdout
    # the start line names the checkpoint's model, not the default preset's
    first = next(line for line in result.stdout.splitlines() if line.startswith("training "))
    assert first.startswith(f"training from {started['folder']} ({started['kind']}, ") and "gpt-micro" not in first
    record = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line][-1]
    assert record["step"] == STOP + 1
    assert record["loss"] == pytest.approx(started["loss"], rel=1e-6)
    assert record["lr"] == pytest.approx(linear_lr(STOP + 1), rel=1e-12)  # logged after the step: the next one's
    assert export_main([str(run_dir), str(tmp_path / "export"), "--format", "hf"]) == 0
    if started["kind"] == "gpt2" and not started["layout"]:  # a later start resumes from the run's own snapshot
        again = train(continue_overrides(run_dir, started, f"trainer.max_steps={STOP + 2}"))
        assert f"from {run_dir / 'snapshots' / 'step_00000003'}" in again.stdout and "continuing" not in again.stdout
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


def test_the_run_takes_the_trainers_settings_and_the_command_line_wins(gpt2_run):
    from triax.config import compose_config

    config = compose_config([f"trainer.continue_from={gpt2_run['folder']}", "trainer.log_every=7",
                             "optim.warmup_steps=1"])
    optim, trainer = config.optim, config.trainer
    assert (optim.lr, optim.min_lr, optim.schedule, optim.warmup_steps) == (LR, 0.0, "linear", 1)
    assert optim.decay_steps == MAX_STEPS
    assert (list(optim.betas), optim.eps, optim.weight_decay, optim.decay) == ([0.9, 0.999], 1e-8, 0.1, "matrices")
    assert optim.fused is True  # the Trainer's default optimizer on torch >= 2.8: adamw_torch_fused
    assert (trainer.max_steps, trainer.batch_size, trainer.grad_clip, trainer.log_every) == (MAX_STEPS, 2, 1.0, 7)
    assert (config.data.vocab_size, config.model.dropout) == (VOCAB, 0.0)


def test_the_best_metric_carries_over_when_it_is_a_logged_eval_loss(gpt2_run):
    from triax.interop.hf_trainer.run import TrainerCheckpoint

    def evaluated(state):
        state["log_history"].append({"eval_loss": 3.25, "step": 2})
        state.update(best_metric=3.25, best_global_step=2)

    rewrite(gpt2_run["folder"], "trainer_state.json", evaluated)
    assert TrainerCheckpoint(str(gpt2_run["folder"])).best_loss == (3.25, 2)
    rewrite(gpt2_run["folder"], "trainer_state.json", lambda state: state.update(best_metric=0.91))  # an accuracy, say
    assert TrainerCheckpoint(str(gpt2_run["folder"])).best_loss is None


@pytest.mark.parametrize("kind, tie, bias", [("gpt2", True, False), ("gpt2", False, False), ("llama", True, False),
                                             ("llama", False, True)])
def test_the_parameter_order_and_decay_groups_are_the_trainers(kind, tie, bias):
    """named_parameters() of the real transformers model, and Trainer.get_decay_parameter_names'
    rule (it reads nothing of the Trainer but the model)."""
    from triax.interop.hf_trainer.run import decayed, parameter_names

    model = hf_model(kind, tie=tie, bias=bias)
    names = [name for name, _ in model.named_parameters()]
    assert parameter_names(model.config.to_dict()) == names
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    assert [name for name in names if decayed(name)] == [name for name in names if name in decay]


def test_the_schedules_are_transformers():
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from triax.train.optim import warmup_cosine

    for schedule, make in (("linear", get_linear_schedule_with_warmup), ("cosine_hf", get_cosine_schedule_with_warmup)):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
        scheduler = make(optimizer, 3, 10)
        for step in range(10):
            expected = scheduler.get_last_lr()[0]
            assert warmup_cosine(step, 10, 3, LR, 0.0, schedule) == pytest.approx(expected, rel=1e-12, abs=1e-18)
            optimizer.step()
            scheduler.step()


def test_a_cosine_run_continues_with_cosine_hf_and_is_refused_without(tmp_path):
    """lr_scheduler_type="cosine" is in training_args.bin only: the rate check catches the
    assumed linear schedule, and optim.schedule=cosine_hf passes it."""
    from triax.errors import ConfigError
    from triax.train import Trainer, compose_config

    run = trainer_run("gpt2", tmp_path, lr_scheduler_type="cosine")
    with pytest.raises(ConfigError, match="optim.schedule=linear") as raised:
        Trainer(compose_config(continue_overrides(tmp_path / "linear", run)))
    assert "\n" not in str(raised.value) and not (tmp_path / "linear").exists()
    trainer = Trainer(compose_config(continue_overrides(tmp_path / "cosine", run, "optim.schedule=cosine_hf")))
    cosine = LR * 0.5 * (1 + np.cos(np.pi * (STOP - WARMUP) / (MAX_STEPS - WARMUP)))  # transformers' at step 2
    assert trainer.step == STOP and trainer.scheduler.get_last_lr()[0] == pytest.approx(cosine, rel=1e-12)


def rewrite(folder, name, change):
    path = folder / name
    if name.endswith(".json"):
        state = json.loads(path.read_text())
        change(state)
        path.write_text(json.dumps(state))
    else:
        saved = torch.load(path, weights_only=True)
        saved = change(saved) or saved
        path.write_bytes(pickled_bytes(saved))


def first_group_short(optimizer):
    optimizer["param_groups"][0]["params"] = optimizer["param_groups"][0]["params"][1:]


def moment_of_another_shape(optimizer):
    optimizer["state"][0]["exp_avg"] = torch.zeros(3)


@pytest.mark.parametrize("name, change, message", [
    ("optimizer.pt", first_group_short, "parameter groups hold [9, 18] parameters, not the [10, 18]"),
    ("optimizer.pt", moment_of_another_shape, "exp_avg of transformer.wte.weight is not a floating tensor"),
    ("optimizer.pt", lambda o: o["param_groups"][0].update(amsgrad=True), "amsgrad=True"),
    ("optimizer.pt", lambda o: o["state"][3].update(step=torch.tensor(7.0)), "step count for"),
    ("optimizer.pt", lambda o: o["param_groups"][1].update(weight_decay=0.5), "second group"),
    ("optimizer.pt", lambda o: ["not", "a", "state_dict"], "holds no optimizer state_dict"),
    ("scheduler.pt", lambda s: s.update(last_epoch=5), "last_epoch=5"),
    ("scheduler.pt", lambda s: s.update(_last_lr="fast"), "holds no LambdaLR state"),
    ("trainer_state.json", lambda s: s.update(global_step="2"), "global_step='2' is not an integer"),
    ("trainer_state.json", lambda s: s.update(global_step=2.0), "global_step=2.0 is not an integer"),
    ("trainer_state.json", lambda s: s.update(max_steps=1), "max_steps=1 is not an integer >= global_step"),
    ("trainer_state.json", lambda s: s.update(global_step=2**60, max_steps=2**61), "and below 2**53"),
    ("trainer_state.json", lambda s: s.update(log_history={"a": 1}), "log_history={'a': 1} is not a list"),
    ("trainer_state.json", lambda s: s.update(best_metric="low"), "best_metric='low' is not a number or null"),
    ("trainer_state.json", lambda s: s.update(best_metric=float("nan")), "NaN is not a number"),
    ("trainer_state.json", lambda s: s.clear(), "global_step=None"),
])
def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, gpt2_run, name, change, message):
    from triax.errors import ConfigError
    from triax.train import Trainer, compose_config

    rewrite(gpt2_run["folder"], name, change)
    with pytest.raises((ConfigError, ValueError)) as raised:
        Trainer(compose_config(continue_overrides(tmp_path / "run", gpt2_run)))
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
def test_a_pickle_that_runs_code_is_refused_with_exit_2(tmp_path, gpt2_run, name):
    marker = tmp_path / "ran"
    (gpt2_run["folder"] / name).write_bytes(pickled_bytes({"state": Payload(marker)}))
    result = train(continue_overrides(tmp_path / "run", gpt2_run), check=False)
    error = result.stderr.strip()
    assert result.returncode == 2 and "weights-only" in error and name in error and len(error.splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_unsafe_files_are_refused(tmp_path, gpt2_run):
    import os

    from triax.errors import ConfigError
    from triax.config import compose_config

    folder = gpt2_run["folder"]
    state = folder / "trainer_state.json"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(state.read_text())
    state.unlink()
    state.symlink_to(elsewhere)  # a link out of the folder: its bytes are not the checkpoint's
    with pytest.raises(ConfigError, match="outside the checkpoint directory"):
        compose_config([f"trainer.continue_from={folder}"])
    state.unlink()
    os.mkfifo(state)  # would block a reader forever
    with pytest.raises(ConfigError, match="not a regular file"):
        compose_config([f"trainer.continue_from={folder}"])
    state.unlink()
    state.write_text('{"global_step": ' * 100000)  # nested past any parser's depth
    with pytest.raises(ConfigError, match="cannot read") as raised:
        compose_config([f"trainer.continue_from={folder}"])
    assert "\n" not in str(raised.value)
    state.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ConfigError, match="cannot read"):
        compose_config([f"trainer.continue_from={folder}"])


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
def test_a_pickled_file_that_is_a_link_or_a_fifo_is_refused(tmp_path, gpt2_run, name):
    import os

    from triax.config import compose_config

    path = gpt2_run["folder"] / name
    elsewhere = tmp_path / "elsewhere.pt"
    elsewhere.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(elsewhere)
    for made in ("link", "fifo"):
        with pytest.raises(OSError) as raised:
            compose_config([f"trainer.continue_from={gpt2_run['folder']}"])
        assert name in str(raised.value) and "\n" not in str(raised.value), made
        path.unlink()
        os.mkfifo(path)


def test_a_state_file_past_its_size_is_refused_before_it_is_read(gpt2_run, monkeypatch):
    from triax.interop.hf_trainer import run as hf_trainer_run
    from triax.errors import ConfigError
    from triax.config import compose_config

    monkeypatch.setattr(hf_trainer_run, "MAX_STATE_BYTES", 64)  # the real bound is 256 MiB
    with pytest.raises(ConfigError, match="bytes, more than the 64"):
        compose_config([f"trainer.continue_from={gpt2_run['folder']}"])


@pytest.mark.multiprocess
def test_a_schedule_the_checkpoint_contradicts_is_refused_with_exit_2(tmp_path, gpt2_run):
    """The run warmed up for one step (training_args.bin, unread): left at the assumed warmup 0,
    the next rate is not scheduler.pt's, and `triax train` says which keys to give, in one line."""
    result = train([f"trainer.continue_from={gpt2_run['folder']}", "data.task=tokens", f"data.path={gpt2_run['data']}",
                    f"trainer.run_dir={tmp_path / 'run'}", f"data.block_size={BLOCK}"], check=False)
    assert result.returncode == 2
    error = result.stderr.strip()
    assert "the Trainer's next learning rate (step 2) is 0.00666667" in error and "warmup_steps" in error
    assert len(error.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_the_checkpoint_is_read_once_a_run(tmp_path, gpt2_run, monkeypatch):
    """compose_run reads the Trainer's checkpoint-N for the config's settings; the trainer continues
    from that reading (its AdamW state, step and notes) and does not open the folder again."""
    from triax.config import compose_run
    from triax.interop.hf_trainer import run as hf_trainer_run
    from triax.train import Trainer

    opened, open_checkpoint = [], hf_trainer_run.open_checkpoint
    monkeypatch.setattr(hf_trainer_run, "open_checkpoint", lambda path: opened.append(path) or open_checkpoint(path))
    trainer = Trainer(*compose_run(continue_overrides(tmp_path / "run", gpt2_run)))
    assert trainer.step == STOP and opened == [str(gpt2_run["folder"])]
