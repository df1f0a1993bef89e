"""The chat path made exact about what it reads and counts: data.shuffle=false reads the file in
order, and such a run equals TRL's SFTTrainer fed the same order (same tiny Llama, same initial
LoRA adapter, answer-only loss), with the whole logits and through the output layer in chunks;
data.batch_padding=true gives the losses of block padding; the logged loss_tokens are the answer
tokens the run read."""

import json
import warnings

import pytest
import torch

from support.chat_files import arithmetic_conversations, write_chat_checkpoint, write_chat_file
from support.helpers import train

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'triax[test]')")
datasets = pytest.importorskip("datasets")

STEPS, BATCH, LR = 10, 4, 5e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-order")
    base = root / "base"
    write_chat_checkpoint(base)
    records = arithmetic_conversations(STEPS * BATCH, seed=3)
    chat = write_chat_file(root / "chat.jsonl", records)
    val = write_chat_file(root / "val.jsonl", arithmetic_conversations(8, seed=4))
    torch.manual_seed(0)
    adapted = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(str(base)),
                                  peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    adapted.save_pretrained(str(root / "adapter"))
    return root, base, records, chat, val


def overrides(root, base, chat, val, run_dir, **extra):
    values = {"model.init_from": base, "data.task": "chat", "data.path": chat, "data.val_path": val,
              "data.block_size": 96, "data.shuffle": "false", "model.lora.rank": 8, "model.lora.alpha": 16,
              "model.lora.targets": "[q,v]", "model.lora.init_from": root / "adapter", "trainer.max_steps": STEPS,
              "trainer.batch_size": BATCH, "trainer.log_every": 1, "trainer.eval_every": 0, "trainer.sample_tokens": 0,
              "trainer.grad_clip": 1.0, "trainer.run_dir": run_dir, "optim.lr": LR, "optim.warmup_steps": 0,
              "optim.schedule": "constant", "optim.weight_decay": 0.0, "optim.betas": "[0.9,0.999]",
              "parallel.dp_replicate": 1, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def records_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"loss"' in line]


@pytest.fixture(scope="module")
def trl_losses(setup, tmp_path_factory):
    """TRL's SFTTrainer fed the records in file order, from the same adapter: its loss of each step."""
    root, base, records, _, _ = setup

    class InOrder(trl.SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(base)),
                                           str(root / "adapter"), is_trainable=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.SFTConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], assistant_only_loss=True,
                             per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
                             lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                             adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1, save_strategy="no",
                             use_cpu=True, seed=0, bf16=False, gradient_checkpointing=False, max_length=None)
        trainer = InOrder(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                          processing_class=transformers.AutoTokenizer.from_pretrained(str(base)))
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# A micro-batch's fp32 logits are 4 x 96 x 301 x 4 bytes = 0.44 MB: under this limit the loss takes the
# output layer 43 positions at a time (triax.objectives.chunked_logits).
CHUNKED = {"parallel.max_logits_mb": 0.05}


@pytest.mark.parametrize("logits", ["whole", "chunked"])
def test_file_order_equals_trl_sft_trainer_fed_the_same_order(setup, trl_losses, tmp_path, logits):
    root, base, records, chat, val = setup
    run_dir = tmp_path / "run"
    train(overrides(root, base, chat, val, run_dir, **(CHUNKED if logits == "chunked" else {})), timeout=400)
    ours, theirs = records_of(run_dir), trl_losses
    assert len(ours) == len(theirs) == STEPS
    for step, (mine, other) in enumerate(zip(ours, theirs)):
        assert abs(mine["loss"] - other) <= 1e-5, (step + 1, mine["loss"], other)
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.1  # it learned: the comparison means something


def test_batch_padding_keeps_the_losses_and_loss_tokens_count_the_answers(setup, tmp_path):
    """One epoch in file order, padded to the block and to each batch's longest row: the same loss
    every step (<= 1e-5) with fewer positions computed (tokens_per_s); the logged loss_tokens add up
    to the epoch's answer tokens, and loss_tokens_per_s is loss_tokens over the interval's time."""
    from triax.data.chat import ChatEncoder, chat_template_for, encode_records, read_records
    from triax.data.tokenizer import BPETokenizer
    from triax.interop.hf.files import description_files

    root, base, _, chat, val = setup
    runs = {}
    for padding in ("false", "true"):
        run_dir = tmp_path / f"batch-padding-{padding}"
        train(overrides(root, base, chat, val, run_dir, **{"data.batch_padding": padding}), timeout=400)
        runs[padding] = records_of(run_dir)
    for block, batch in zip(runs["false"], runs["true"]):
        assert abs(block["loss"] - batch["loss"]) <= 1e-5, (block, batch)
        assert block["loss_tokens"] == batch["loss_tokens"]
        # tokens_per_s counts the positions computed: a whole block a row, or the batch's longest row.
        assert abs(block["tokens_per_s"] * block["step_time_s"] - BATCH * 96) <= 0.01 * BATCH * 96
        assert batch["tokens_per_s"] * batch["step_time_s"] < 0.8 * BATCH * 96
        assert abs(batch["loss_tokens_per_s"] - batch["loss_tokens"] / batch["step_time_s"]) <= \
            0.01 * batch["loss_tokens_per_s"] + 1
    template = chat_template_for(None, description_files(str(base)), str(base))
    encoder = ChatEncoder(template, BPETokenizer.from_file(str(base / "tokenizer.json")).tokenizer)
    examples = encode_records(read_records(str(chat)), encoder, 96, "truncate").examples
    answers = sum(sum(example.mask[1:]) for example in examples)
    assert sum(record["loss_tokens"] for record in runs["true"]) == answers > 0
