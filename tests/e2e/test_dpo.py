"""DPO (data.task=preference, dpo.*) side by side with TRL's DPOTrainer: the same tiny Llama, the
same pairs in the same order (data.shuffle=false; TRL with a sequential sampler), LoRA of rank 8
on q and v from the same initial adapter, beta 0.1, AdamW at a constant rate: the loss and rewards
of every step within 1e-5 for the first steps and 1e-4 over 30 (also with the logits taken through
the output layer in chunks of positions), and `triax eval` equal to TRL's evaluate(); FSDP x 2 and
TP x 2 (also in chunks) end with the one-process adapters; a bitwise resume after SIGKILL; PEFT and
merged exports; one line for what DPO cannot run."""

import json
import warnings

import pytest
import torch

from support.chat_files import write_chat_checkpoint
from support.forked import launch
from support.helpers import assert_adam_close, final_weights, train
from support.preference_files import preference_records, write_preference_file

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'triax[test]')")
datasets = pytest.importorskip("datasets")

STEPS, BATCH, LR, BETA = 30, 4, 5e-3, 0.1
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama with a chat template, its pairs, and an initial PEFT adapter whose B is not zero
    (so the first step already moves the rewards, and the reference is that adapter, TRL's "ref")."""
    root = tmp_path_factory.mktemp("dpo")
    base = root / "base"
    write_chat_checkpoint(base)
    records = preference_records(STEPS * BATCH, "conversational", seed=7)
    pairs = write_preference_file(root / "pairs.jsonl", records)
    val = write_preference_file(root / "val.jsonl", preference_records(16, "conversational", seed=8))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                         lora_dropout=0.0))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    adapted.save_pretrained(str(root / "adapter"))
    return root, base, records, pairs, val


def triax_overrides(root, base, pairs, val, run_dir, **extra):
    values = {"model.init_from": base, "data.task": "preference", "data.path": pairs, "data.val_path": val,
              "data.block_size": 64, "data.shuffle": "false", "model.lora.rank": 8, "model.lora.alpha": 16,
              "model.lora.targets": "[q,v]", "dpo.beta": BETA, "trainer.max_steps": STEPS,
              "trainer.batch_size": BATCH, "trainer.log_every": 1, "trainer.eval_every": 0, "trainer.sample_tokens": 0,
              "trainer.grad_clip": 1.0, "trainer.run_dir": run_dir, "optim.lr": LR, "optim.warmup_steps": 0,
              "optim.schedule": "constant", "optim.weight_decay": 0.0, "optim.betas": "[0.9,0.999]",
              "parallel.dp_replicate": 1, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def trl_curve(root, base, records, steps=STEPS, lora=True, **options):
    """TRL's DPOTrainer on the same pairs in file order: its logged loss and rewards per step
    (lora=False: every weight trains, the reference a second copy of the base, TRL's own)."""

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base))
    if lora:
        model = peft.PeftModel.from_pretrained(model, str(root / "adapter"), is_trainable=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.DPOConfig(output_dir=str(root / "trl"), report_to=[], max_length=64, beta=BETA,
                             per_device_train_batch_size=BATCH, max_steps=steps, **{"learning_rate": LR, **options},
                             lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                             adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1,
                             save_strategy="no", use_cpu=True, seed=0, dataloader_drop_last=True,
                             bf16=False, gradient_checkpointing=False)  # TRL defaults to bf16: fp32 as triax
        trainer = InOrder(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                          processing_class=tokenizer)
        trainer.train()
    return [entry for entry in trainer.state.log_history if "rewards/chosen" in entry], trainer


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """triax's run (validated on val.jsonl at its last step) and TRL's, from the same adapter."""
    root, base, records, pairs, val = setup
    run_dir = tmp_path_factory.mktemp("triax") / "run"
    output = train(triax_overrides(root, base, pairs, val, run_dir, **{"model.lora.init_from": root / "adapter",
                                                                        "trainer.eval_every": STEPS}), timeout=400)
    ours = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    history, trainer = trl_curve(root, base, records)
    return run_dir, ours, history, trainer, output.stdout


def test_dpo_equals_trl_dpo_trainer_step_by_step(runs):
    _, ours, theirs, _, _ = runs
    ours = [record for record in ours if "loss" in record]
    assert len(ours) == len(theirs) == STEPS
    for step, (mine, other) in enumerate(zip(ours, theirs)):
        tolerance = 1e-5 if step < 5 else 1e-4
        for name in METRICS:
            assert abs(mine[name] - other[name]) <= tolerance, (step + 1, name, mine[name], other[name])
    # The comparison means something: the policy starts as its reference (margin 0, loss log 2), then the
    # rewards move apart and the loss goes down.
    assert ours[0]["rewards/margins"] == 0 and ours[1]["rewards/margins"] != 0
    late = sum(record["rewards/margins"] for record in ours[-5:]) / 5
    assert late > 0.05 and sum(record["loss"] for record in ours[-5:]) / 5 < ours[0]["loss"] - 0.02, ours[-5:]


# A micro-batch's fp32 logits are 8 x 64 x 301 (302 under TP) x 4 bytes = 0.62 MB: under this limit
# both forwards take the output layer 43 positions at a time (triax.objectives.chunked_logits).
CHUNKED = {"parallel.max_logits_mb": 0.05}


def test_logits_in_chunks_equal_trl_dpo_trainer_step_by_step(setup, runs, tmp_path):
    root, base, _, pairs, val = setup
    train(triax_overrides(root, base, pairs, val, tmp_path / "run", **{"model.lora.init_from": root / "adapter"},
                          **CHUNKED), timeout=400)
    ours = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in line]
    theirs = runs[2]
    assert len(ours) == len(theirs) == STEPS
    for step, (mine, other) in enumerate(zip(ours, theirs)):
        tolerance = 1e-5 if step < 5 else 1e-4
        for name in METRICS:
            assert abs(mine[name] - other[name]) <= tolerance, (step + 1, name, mine[name], other[name])


def test_the_step_line_shows_reward_accuracy_and_margin(runs):
    _, ours, _, _, output = runs
    record = [record for record in ours if "loss" in record][-1]
    assert f" of {BATCH} pairs (" in output.splitlines()[0]  # the start line counts a step in pairs
    line = next(line for line in output.splitlines() if line.startswith(f"step {STEPS}/{STEPS}"))
    assert (f"rewards/accuracies {record['rewards/accuracies']:.3f} | rewards/margins "
            f"{record['rewards/margins']:.4f}") in line, line


@pytest.mark.parametrize("key, value, words", [
    ("model.init_from", "null", "model.init_from"),
    ("dpo.beta", 0, "dpo.beta"),
    ("dpo.loss_type", "kto", "dpo.loss_type"),
    ("dpo.label_smoothing", 0.1, "robust"),
    ("dpo.label_smoothing", 0.5, "dpo.label_smoothing"),
    ("data.truncation_mode", "middle", "data.truncation_mode"),
    ("data.packing", "true", "data.packing"),
])
def test_what_dpo_cannot_run_is_one_line(setup, tmp_path, key, value, words):
    root, base, _, pairs, val = setup
    result = train(triax_overrides(root, base, pairs, val, tmp_path / "run", **{key: value}), check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.stderr[-2000:]


def test_eval_reports_trl_metrics_on_a_validation_file(setup, runs):
    """`triax eval RUN --preference val.jsonl` gives the run's own last validation figures, and those
    TRL's evaluate() gives on the same file after its 30 steps (<= 1e-4)."""
    root, _, _, _, val = setup
    run_dir, ours, _, trainer, _ = runs
    result = launch(1, ["-m", "triax", "eval", str(run_dir), "--preference", str(val), "--json"])
    found = json.loads(result.stdout.strip().splitlines()[-1])
    last = [record for record in ours if "val_loss" in record][-1]
    assert found["pairs"] == last["val_pairs"] == 16
    assert abs(found["loss"] - last["val_loss"]) < 1e-6
    for name in METRICS[1:]:
        assert abs(found[name] - last[f"val_{name}"]) < 1e-6, name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.args.per_device_eval_batch_size = 8
        theirs = trainer.evaluate(datasets.Dataset.from_list([json.loads(line) for line in open(val)]))
    assert abs(found["loss"] - theirs["eval_loss"]) < 1e-4, (found, theirs)
    for name in METRICS[1:]:
        assert abs(found[name] - theirs[f"eval_{name}"]) < 1e-4, (name, found, theirs)


@pytest.mark.parametrize("layout, nproc, settings", [
    ("fsdp2", 2, {"parallel.dp_shard": 2, "trainer.batch_size": BATCH // 2}),
    ("tp2", 2, {"parallel.tp": 2}),
    ("tp2_chunked", 2, {"parallel.tp": 2, **CHUNKED}),
])
def test_layouts_end_with_the_one_process_adapters(setup, runs, tmp_path, layout, nproc, settings):
    """FSDP x 2 (two pairs a rank) and TP x 2 (adapters split like their layers) train the adapters
    the one-process run trains, from the same initial adapter and reference."""
    root, base, _, pairs, val = setup
    run_dir = tmp_path / layout
    train(triax_overrides(root, base, pairs, val, run_dir, **{"model.lora.init_from": root / "adapter",
                                                               "trainer.eval_every": STEPS, **settings}),
          nproc=nproc, timeout=600)
    mine, single = final_weights(run_dir), final_weights(runs[0])
    assert sorted(mine) == sorted(single) and len(single) == 2 * 2 * 2  # q and v, 2 blocks, A and B
    differences = torch.cat([(mine[name].float() - single[name].float()).abs().flatten() for name in single])
    # Within 1e-5 but for at most one element in a thousand: an element whose gradient is near zero has
    # Adam's update m/sqrt(v) set by rounding (another reduction order), so it may move up to ~lr a step
    # differently (assert_adam_close's outlier rule). Measured: FSDP all <= 1e-5; TP 1 of 2048 at 5e-5.
    assert (differences > 1e-5).float().mean() <= 1e-3, (layout, differences.max())
    assert_adam_close(mine, single, [LR] * STEPS)
    assert sum(single[name].abs().sum() for name in single) > 0


def test_fresh_adapters_resume_after_sigkill_bitwise_and_export_as_peft(setup, tmp_path):
    """New adapters (B = 0): the reference is the base with them off, so the first step is at log 2
    and the rewards then part. Killed after the snapshot of step 2 and started again, the run ends
    with the uninterrupted run's adapters, bit for bit; `--format peft` exports them for PEFT."""
    import sys

    from support.helpers import assert_bitwise_equal, kill_after_snapshot_and_resume

    root, base, _, pairs, val = setup
    settings = {"trainer.max_steps": 8, "trainer.save_every": 2, "data.shuffle": "true"}
    whole = tmp_path / "whole"
    train(triax_overrides(root, base, pairs, val, whole, **settings), timeout=400)
    records = [json.loads(line) for line in open(whole / "metrics.jsonl")]
    assert records[0]["rewards/margins"] == 0 and abs(records[0]["loss"] - 0.693147) < 1e-6
    assert all(record["rewards/margins"] != 0 for record in records[1:])
    run_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "triax", "train", *triax_overrides(root, base, pairs, val, run_dir, **settings)]
    kill_after_snapshot_and_resume(command, run_dir)
    assert_bitwise_equal(final_weights(run_dir), final_weights(whole))
    out = tmp_path / "adapter"
    launch(1, ["-m", "triax", "export", str(whole), str(out), "--format", "peft"])
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(base)), str(out))
    weights = final_weights(whole)
    exported = {name: parameter for name, parameter in model.named_parameters() if "lora_" in name}
    assert len(exported) == len(weights) == 8
    for name, tensor in weights.items():  # layers.0.attn.q_proj.lora_A.weight -> PEFT's ...q_proj.lora_A.default.weight
        layer, _, factor = name.rpartition(".lora_")
        match = [value for key, value in exported.items()
                 if key.endswith(f"layers.{layer.split('.')[1]}.self_attn.{layer.rsplit('.', 1)[1]}.lora_{factor[0]}"
                                 ".default.weight")]
        assert len(match) == 1 and torch.equal(match[0].detach(), tensor), name
    # Merged into the base: a plain LlamaForCausalLM with PEFT's merged model's logits.
    merged_dir = tmp_path / "merged"
    launch(1, ["-m", "triax", "export", str(whole), str(merged_dir), "--format", "hf", "--merge"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss_type, smoothing", [("ipo", 0.0), ("robust", 0.1), ("hinge", 0.0)])
def test_other_losses_equal_trl(setup, tmp_path, loss_type, smoothing):
    """dpo.loss_type ipo, robust (with dpo.label_smoothing) and hinge: TRL's loss and rewards for 4 steps."""
    root, base, records, pairs, val = setup
    run_dir = tmp_path / "run"
    train(triax_overrides(root, base, pairs, val, run_dir, **{"model.lora.init_from": root / "adapter",
                                                               "trainer.max_steps": 4, "dpo.loss_type": loss_type,
                                                               "dpo.label_smoothing": smoothing}), timeout=400)
    ours = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    theirs, _ = trl_curve(root, base, records, steps=4, loss_type=[loss_type], label_smoothing=smoothing)
    assert len(ours) == len(theirs) == 4
    for step, (mine, other) in enumerate(zip(ours, theirs)):
        for name in METRICS:
            assert abs(mine[name] - other[name]) <= 1e-5, (loss_type, step + 1, name, mine[name], other[name])
    assert len({round(record["loss"], 6) for record in ours}) > 1


NO_LORA = {"model.lora.rank": 0, "trainer.max_steps": 4, "optim.lr": 1e-3, "trainer.eval_every": 4}


def test_without_lora_the_reference_is_a_frozen_copy_equal_to_trl(setup, tmp_path):
    """Every weight trains; the reference is model.init_from built again, frozen: TRL's loss and
    rewards (its reference a second copy of the base) for 4 steps, and FSDP x 2 and TP x 2 (each
    model sharded or split, neither whole on a rank) end with the one-process weights."""
    root, base, records, pairs, val = setup
    single = tmp_path / "single"
    train(triax_overrides(root, base, pairs, val, single, **NO_LORA), timeout=400)
    ours = [json.loads(line) for line in open(single / "metrics.jsonl") if '"loss"' in line]
    theirs, _ = trl_curve(root, base, records, steps=4, lora=False, learning_rate=1e-3)
    assert len(ours) == len(theirs) == 4
    for step, (mine, other) in enumerate(zip(ours, theirs)):
        for name in METRICS:
            assert abs(mine[name] - other[name]) <= 1e-5, (step + 1, name, mine[name], other[name])
    assert ours[0]["rewards/margins"] == 0 and ours[-1]["rewards/margins"] != 0
    one = final_weights(single)
    for layout, settings in (("fsdp", {"parallel.dp_shard": 2, "trainer.batch_size": BATCH // 2}),
                             ("tp", {"parallel.tp": 2})):
        train(triax_overrides(root, base, pairs, val, tmp_path / layout, **{**NO_LORA, **settings}), nproc=2,
              timeout=600)
        # Tensor parallelism pads the vocabulary to a multiple of tp: the real rows are compared.
        mine = {name: tensor[:one[name].shape[0]] for name, tensor in final_weights(tmp_path / layout).items()}
        assert sorted(mine) == sorted(one) and len(one) > 8  # every weight, not adapters
        assert_adam_close(mine, one, [1e-3] * 4)
        worst = max((mine[name].float() - one[name].float()).abs().max().item() for name in one)
        assert worst <= 1e-5, (layout, worst)
