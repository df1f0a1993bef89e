"""LoRA fine-tuning of a tiny Llama on a chat file (data.task=chat, model.lora.*): the same adapters
in one process, FSDP x 2 and TP x 2; a bitwise resume after SIGKILL; snapshots that hold only the
adapters; a `--format peft` export that PEFT loads with triax's logits; the answer-only validation
loss goes down; model.lora.init_from reads a PEFT adapter back."""

import json
import sys

import pytest
import torch

from support.chat_files import arithmetic_conversations, write_chat_checkpoint, write_chat_file
from support.forked import launch
from support.helpers import (assert_adam_close, assert_bitwise_equal, final_weights, kill_after_snapshot_and_resume,
                             train)
from support.llama_checkpoints import VOCAB

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'triax[test]')")

LR = 1e-2
STEPS = 6
LORA = {"model.lora.rank": 4, "model.lora.alpha": 8, "model.lora.targets": "[all-linear]"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat-base") / "base"
    write_chat_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_chat_file(tmp_path_factory.mktemp("chat-data") / "chat.jsonl", arithmetic_conversations(48, seed=1))


def overrides(run_dir, base, chat_file, **extra):
    values = {"model.init_from": base, "data.task": "chat", "data.path": chat_file, "data.block_size": 64,
              **LORA, "trainer.max_steps": STEPS, "trainer.batch_size": 4, "trainer.eval_every": STEPS,
              "trainer.log_every": 1, "trainer.sample_tokens": 0, "trainer.run_dir": run_dir,
              "optim.lr": LR, "optim.warmup_steps": 0, "parallel.dp_replicate": 1, **extra}
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def single(tmp_path_factory, base, chat_file):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    train(overrides(run_dir, base, chat_file, **{"trainer.save_every": 2}), timeout=300)
    return run_dir


def test_snapshots_hold_only_the_adapters_and_the_base_stays_frozen(single, base):
    weights = final_weights(single)
    names = sorted(weights)
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names), names
    # 7 adapted layers per block (all-linear), 2 blocks, A and B each.
    assert len(names) == 2 * 7 * 2
    assert any(weights[name].abs().max() > 0 for name in names if ".lora_B." in name)  # B trained away from zero


@pytest.mark.parametrize("layout, nproc, settings", [
    ("fsdp2-checkpointed", 2, {"parallel.dp_shard": 2, "trainer.batch_size": 2,
                               "parallel.activation_checkpointing": "full"}),
    ("tp2", 2, {"parallel.tp": 2}),
])
def test_layouts_train_the_same_adapters(layout, nproc, settings, tmp_path, base, chat_file, single):
    run_dir = tmp_path / layout
    train(overrides(run_dir, base, chat_file, **settings), nproc=nproc, timeout=400)
    assert_adam_close(final_weights(run_dir), final_weights(single), [LR] * STEPS)


def test_answer_only_validation_loss_goes_down(single):
    records = [json.loads(line) for line in open(single / "metrics.jsonl")]
    losses = [record["val_loss"] for record in records if "val_loss" in record]
    first = [record["loss"] for record in records if "loss" in record][0]
    # The first step's training loss is the base's (B starts at zero); validation after training is lower.
    assert losses[-1] < first - 0.1, (first, losses)


def test_peft_loads_the_export_with_triax_logits(single, base, tmp_path):
    """`--format peft` -> PeftModel.from_pretrained(base, OUT): the same logits as triax's model with
    the snapshot's adapters (|diff| <= 1e-5 in fp32); model.lora.init_from reads the export back
    into the same tensors."""
    from triax.interop.hf.whole_model import load_hf_model
    from triax.models.lora import LoRAConfig, apply_lora
    from triax.interop.peft.adapter import load_adapter

    out = tmp_path / "adapter"
    launch(1, ["-m", "triax", "export", str(single), str(out), "--format", "peft"])
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    weights = final_weights(single)
    ours = load_hf_model(str(base), torch.device("cpu"))
    lora = LoRAConfig(rank=4, alpha=8, targets=["all-linear"])
    apply_lora(ours, lora)
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if name in weights:
                parameter.data = weights[name].clone()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(base)).eval()
    reference = peft.PeftModel.from_pretrained(hf_base, str(out)).eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        triax_logits, peft_logits = ours(ids), reference(ids).logits
        plain_logits = load_hf_model(str(base), torch.device("cpu"))(ids)
    torch.testing.assert_close(triax_logits, peft_logits, atol=1e-5, rtol=1e-5)
    assert (triax_logits - plain_logits).abs().max() > 1e-3  # the adapters change the model
    # Read back (model.lora.init_from): every adapter tensor as trained.
    again = load_hf_model(str(base), torch.device("cpu"))
    apply_lora(again, lora)
    for parameter in again.parameters():
        if parameter.is_meta:
            parameter.data = torch.empty_like(parameter, device="cpu")
    load_adapter(again, str(out), lora)
    for name, parameter in again.named_parameters():
        if name in weights:
            assert torch.equal(parameter, weights[name]), name


def test_resume_after_sigkill_is_bitwise(tmp_path, base, chat_file, single):
    """Killed after the snapshot of step 2, started again: the adapters equal the uninterrupted run's."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "triax", "train",
               *overrides(run_dir, base, chat_file, **{"trainer.save_every": 2})]
    kill_after_snapshot_and_resume(command, run_dir)
    assert_bitwise_equal(final_weights(run_dir), final_weights(single))


@pytest.mark.parametrize("key, value, words", [
    ("model.lora.rank", -1, "model.lora.rank"),
    ("model.lora.targets", "[q,wq]", "'wq'"),
    ("model.lora.alpha", 0, "model.lora.alpha"),
    ("model.lora.dropout", 1.5, "model.lora.dropout"),
    ("data.overlong", "shrink", "data.overlong"),
    ("data.chat_template", "vicuna", "data.chat_template"),
])
def test_bad_lora_and_chat_settings_are_one_line(tmp_path, base, chat_file, key, value, words):
    result = train(overrides(tmp_path / "run", base, chat_file, **{key: value}), check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.stderr[-2000:]


def test_packed_and_padded_runs_report_the_same_validation_loss(tmp_path, base, chat_file):
    """After one step at a negligible learning rate, packing (several conversations per row, each
    confined to itself) scores the validation answers exactly as padding does."""
    losses = {}
    for packing in (False, True):
        run_dir = tmp_path / f"packing-{packing}"
        train(overrides(run_dir, base, chat_file, **{"data.packing": packing, "data.block_size": 128,
                                                     "trainer.max_steps": 1, "trainer.eval_every": 1,
                                                     "optim.lr": 1e-12, "optim.min_lr": 0.0}), timeout=300)
        records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        losses[packing] = [(r["val_loss"], r["val_tokens"]) for r in records if "val_loss" in r][-1]
    assert losses[True][1] == losses[False][1] > 0
    assert abs(losses[True][0] - losses[False][0]) < 1e-5, losses


def test_generate_chat_answers_with_the_template_and_stops_at_the_end_of_turn(single, base, capsys):
    """`triax generate RUN --chat`: the prompt is transformers' rendering with the generation prompt,
    the answer is the greedy continuation of triax's LoRA model, cut at <|eot_id|>."""
    from triax.commands.cli import main
    from triax.interop.hf.whole_model import load_hf_model
    from triax.models.lora import LoRAConfig, apply_lora
    from support.chat_files import hf_tokenizer, LLAMA3_TEMPLATE

    assert main(["generate", str(single), "--chat", "two plus two?", "--greedy", "--tokens", "20"]) == 0
    answer = capsys.readouterr().out.rstrip("\n")
    hf = hf_tokenizer(base, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    prompt = hf.apply_chat_template([{"role": "user", "content": "two plus two?"}], tokenize=True,
                                    add_generation_prompt=True, return_dict=True)["input_ids"]
    model = load_hf_model(str(base), torch.device("cpu"))
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=["all-linear"]))
    weights = final_weights(single)
    for name, parameter in model.named_parameters():
        if name in weights:
            parameter.data = weights[name].clone()
    ids = torch.tensor([list(prompt)])
    expected = []
    with torch.no_grad():
        for _ in range(20):
            next_id = int(model(ids)[0, -1].argmax())
            if next_id == hf.convert_tokens_to_ids("<|eot_id|>"):
                break
            expected.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    assert answer == hf.decode(expected)


def test_eval_scores_a_chat_file_on_its_answers_as_the_run_does(single, chat_file, base, capsys):
    """`triax eval RUN --split val` of a LoRA chat run reports the run's own final val_loss (the
    answers of the validation conversations); `--chat FILE` scores a file's answers, and the base
    model scores them worse."""
    from triax.commands.cli import main

    records = [json.loads(line) for line in open(single / "metrics.jsonl")]
    val_loss, val_tokens = [(r["val_loss"], r["val_tokens"]) for r in records if "val_loss" in r][-1]
    assert main(["eval", str(single), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == val_tokens and abs(result["loss"] - val_loss) < 1e-5
    assert main(["eval", str(single), "--chat", str(chat_file), "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert main(["eval", str(base), "--chat", str(chat_file), "--json"]) == 0
    original = json.loads(capsys.readouterr().out)
    assert tuned["tokens"] == original["tokens"] > 0 and tuned["loss"] < original["loss"]
    assert main(["eval", str(base), "--chat", str(chat_file)]) == 0  # the line says what it counted
    assert f"{chat_file}: {original['tokens']} answer tokens, loss " in capsys.readouterr().out


def test_lora_init_from_continues_from_a_peft_adapter(single, base, chat_file, tmp_path):
    """model.lora.init_from=ADAPTER: the run starts from the exported adapters, so after one step at a
    negligible learning rate it reports the validation loss the exporting run ended with."""
    adapter = tmp_path / "adapter"
    launch(1, ["-m", "triax", "export", str(single), str(adapter), "--format", "peft"])
    run_dir = tmp_path / "continued"
    train(overrides(run_dir, base, chat_file, **{"model.lora.init_from": adapter, "trainer.max_steps": 1,
                                                 "trainer.eval_every": 1, "optim.lr": 1e-12, "optim.min_lr": 0.0}))
    final = [json.loads(line) for line in open(single / "metrics.jsonl")]
    continued = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    expected = [r["val_loss"] for r in final if "val_loss" in r][-1]
    assert abs([r["val_loss"] for r in continued if "val_loss" in r][-1] - expected) < 1e-5


@pytest.mark.parametrize("change, words", [
    ({"r": 2}, "r=2"),
    ({"lora_alpha": "big"}, "lora_alpha='big'"),
    ({"target_modules": ["q_proj"]}, "target_modules"),
    ({"use_dora": True}, "use_dora"),
    ({"peft_type": "IA3"}, "peft_type must be LORA"),
])
def test_an_adapter_that_does_not_match_is_one_line(single, tmp_path, change, words):
    from triax.models.lora import LoRAConfig
    from triax.interop.peft.adapter import AdapterError, load_adapter

    adapter = tmp_path / "adapter"
    launch(1, ["-m", "triax", "export", str(single), str(adapter), "--format", "peft"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AdapterError) as caught:
        load_adapter(torch.nn.Linear(2, 2), str(adapter), LoRAConfig(rank=4, alpha=8, targets=["all-linear"]))
    assert "\n" not in str(caught.value) and words in str(caught.value)


def test_merged_export_is_loaded_by_transformers_with_triax_logits(single, base, tmp_path):
    """`--format hf --merge`: the base with the adapters merged in, a plain LlamaForCausalLM with the
    LoRA model's logits."""
    from triax.runs.chat_generate import load_chat_model, run_config

    out = tmp_path / "merged"
    launch(1, ["-m", "triax", "export", str(single), str(out), "--format", "hf", "--merge"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ours = load_chat_model(str(single), run_config(str(single)), torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]  # the checkpoint's, kept


def test_sampled_chat_answers_stop_at_any_special_token_and_print_none(single, capsys):
    """Sampled nearly uniformly, an answer soon draws a header or begin-of-text token (not only
    <|eot_id|>): it ends there, and no special token is printed."""
    from triax.commands.cli import main

    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    for seed in range(3):
        assert main(["generate", str(single), "--chat", "two plus two?", "--temperature", "1000", "--tokens", "60",
                     "--seed", str(seed)]) == 0
        answer = capsys.readouterr().out
        assert not any(special in answer for special in specials), answer


def test_an_answer_ends_at_the_first_special_token_it_draws(single, monkeypatch, capsys):
    """Whatever the sampling drew: a header token in the middle of an answer ends it there (the old
    rule stopped only at <|eot_id|> and printed `<|start_header_id|>user...`)."""
    from tokenizers import Tokenizer

    import triax.runs.chat_generate as chat_generate
    from triax.commands.cli import main

    tokenizer = Tokenizer.from_file(str(single / "tokenizer.json"))
    words, header = tokenizer.encode("four.").ids, tokenizer.token_to_id("<|start_header_id|>")
    real = chat_generate.load_chat_model

    def drawing_a_header(run_dir, config, device):
        model = real(run_dir, config, device)
        model.generate = lambda idx, count, **options: torch.cat(
            [idx, torch.tensor([[*words, header, *words]])], dim=1)
        return model

    monkeypatch.setattr(chat_generate, "load_chat_model", drawing_a_header)
    assert main(["generate", str(single), "--chat", "two plus two?", "--tokens", "20"]) == 0
    assert capsys.readouterr().out == "four.\n"


def test_a_first_chat_run_on_20_conversations_trains_with_the_default_batch(tmp_path, base):
    """The default batch of 32 is more than 20 conversations hold (18 train, 2 validate): it is
    lowered to fit, with a line saying so, and the run trains."""
    chat = write_chat_file(tmp_path / "mine.jsonl", arithmetic_conversations(20, seed=3))
    done = train([f"model.init_from={base}", "data.task=chat", f"data.path={chat}", "data.block_size=64",
                  "model.lora.rank=4", "trainer.max_steps=2", "trainer.sample_tokens=0",
                  f"trainer.run_dir={tmp_path / 'run'}"])
    assert "trainer.batch_size 32 lowered to 18: the training set has 18 samples" in done.stdout, done.stdout
    assert "2 steps of 18 samples (1 step/epoch)" in done.stdout and "done: 2 steps" in done.stdout, done.stdout


def test_the_batch_is_lowered_only_when_the_data_is_smaller_and_never_below_one_per_rank():
    from triax.errors import ConfigError
    from triax.train.batch_fit import fit_batch_size

    assert fit_batch_size(32, 1000, 2, 1) == (32, None)
    assert fit_batch_size(32, 18, 1, 1)[0] == 18
    assert fit_batch_size(32, 19, 2, 2)[0] == 4  # 4 x 2 ranks x 2 accumulated = 16 <= 19
    with pytest.raises(ConfigError, match="one step needs at least 4 samples"):
        fit_batch_size(32, 3, 2, 2)


def test_the_merged_export_computes_with_the_thread_rules_count(single, tmp_path, monkeypatch):
    """`export --format hf --merge` multiplies the adapters into the base on this CPU: with the
    threads of triax.runtime.threads (here a machine whose sample finds 0.3 of 2 cores idle: one)."""
    import triax.runtime.threads as threads
    from triax.commands.cli import main

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: 0.3)
    torch.set_num_threads(2)
    try:
        assert main(["export", str(single), str(tmp_path / "merged"), "--format", "hf", "--merge"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
