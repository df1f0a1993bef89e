"""DPO (data.task=preference, dpo.*) side by side with TRL's DPOTrainer: the same tiny Llama, the
same pairs in the same order (data.shuffle=false; TRL with a sequential sampler), LoRA of rank 8
on q and v from the same initial adapter, beta 0.1, AdamW at a constant rate: the loss and rewards
of every step within 1e-5 for the first steps and 1e-4 over 30; one line for what DPO cannot run."""

import json
import warnings

import pytest
import torch

from chat_files import write_chat_checkpoint
from forked import launch
from helpers import final_weights, train
from preference_files import preference_records, write_preference_file

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


def trl_curve(root, base, records):
    """TRL's DPOTrainer on the same pairs in file order: its logged loss and rewards per step."""

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(base)),
                                           str(root / "adapter"), is_trainable=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.DPOConfig(output_dir=str(root / "trl"), report_to=[], max_length=64, beta=BETA,
                             per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
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
    train(triax_overrides(root, base, pairs, val, run_dir, **{"model.lora.init_from": root / "adapter",
                                                               "trainer.eval_every": STEPS}), timeout=400)
    ours = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    history, trainer = trl_curve(root, base, records)
    return run_dir, ours, history, trainer


def test_dpo_equals_trl_dpo_trainer_step_by_step(runs):
    _, ours, theirs, _ = runs
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



@pytest.mark.parametrize("key, value, words", [
    ("model.lora.rank", 0, "model.lora.rank"),
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
    run_dir, ours, _, trainer = runs
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
