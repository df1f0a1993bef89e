"""`triax export --format hf` of a run fine-tuned from a transformers checkpoint (`model.init_from`)
is a drop-in replacement of that checkpoint: transformers reads the same config (token ids,
sliding window, the checkpoint's max_position_embeddings above the window-capped context, rotary
settings, dtype), the same generation config and the same tokenizer from the export, and computes
the same logits, also past the sliding window. Tiny random Llama, Qwen2, Mistral and GPT-2
checkpoints and their tokenizer are made here (nothing downloaded)."""

import pytest
import torch

from support.helpers import tiny_overrides
from support.llama_checkpoints import LLAMA3_ROPE, VOCAB, hf_model, train_tokenizer
from triax.commands.cli import main as triax_main

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")

WINDOW = 16  # the sliding window of the Qwen2 and Mistral checkpoints: triax's context is capped there
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the tokenizer's three special tokens
OPTIONS = {
    "llama": dict(rope_scaling=LLAMA3_ROPE, rope_theta=5000.0, tie_word_embeddings=True),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # Saved in bf16, which the export must keep as the dtype it loads in (its weights stay fp32).
    "mistral": dict(sliding_window=WINDOW, dtype=torch.bfloat16),
    "gpt2": dict(n_positions=64, n_embd=32, n_layer=2, n_head=2),
}
# Longer than the window: an export that drops sliding_window attends further back and differs.
SEQUENCE = 24


def save_source(directory, model_type, corpus):
    """save_pretrained's directory with every description file a hub checkpoint has: config.json,
    generation_config.json, and the tokenizer as PreTrainedTokenizerFast saves it."""
    options = dict(OPTIONS[model_type])
    dtype = options.pop("dtype", torch.float32)
    if model_type == "gpt2":
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, **TOKENS, **options))
    else:
        model = hf_model(model_type, **TOKENS, **options).to(dtype)
    model.generation_config = transformers.GenerationConfig(**TOKENS, do_sample=True, temperature=0.7, top_p=0.9,
                                                            max_new_tokens=20)
    model.save_pretrained(directory)
    train_tokenizer(corpus, directory / "tokenizer.json", special_tokens=["<pad>", "<s>", "</s>"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                     pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                                     model_max_length=64)
    tokenizer.save_pretrained(directory)


def fine_tuned_export(tmp_path, source, corpus, **extra):
    """A run started from `source`, one step at a negligible learning rate, exported."""
    run_dir, out = tmp_path / "run", tmp_path / "export"
    assert triax_main(["train", *tiny_overrides(run_dir, corpus, **{
        "model.init_from": str(source), "data.block_size": WINDOW, "trainer.max_steps": 1, "optim.lr": 1e-12,
        "optim.min_lr": 0.0, "optim.warmup_steps": 0, **extra})]) == 0
    assert triax_main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    return run_dir, out


def config_of(directory):
    values = transformers.AutoConfig.from_pretrained(str(directory)).to_dict()
    values.pop("_name_or_path", None)
    return values


def assert_drop_in(source, exported):
    """transformers reads the same config, generation config and tokenizer from both directories,
    and computes the same logits from them."""
    theirs, ours = config_of(source), config_of(exported)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "sliding_window", "max_position_embeddings",
                "rope_parameters", "tie_word_embeddings", "dtype"):
        assert ours.get(key) == theirs.get(key), key  # the fields named first, for a readable failure
    assert ours == theirs
    assert (transformers.GenerationConfig.from_pretrained(str(exported)).to_dict()
            == transformers.GenerationConfig.from_pretrained(str(source)).to_dict())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (source / name).read_bytes(), name
    original, copy = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (source, exported))
    text = "the quick brown fox jumps over the lazy dog"
    assert copy(text)["input_ids"] == original(text)["input_ids"]
    assert (copy.bos_token_id, copy.eos_token_id, copy.pad_token_id) == (1, 2, 0)

    ids = torch.randint(3, 300, (2, SEQUENCE), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()(ids).logits
                  for d in (source, exported)]
    assert logits[1].dtype == logits[0].dtype
    # One step at lr 1e-12 moves each weight by about 1e-12, far below fp32 round-off (and the bf16
    # checkpoint's weights round back to themselves): what remains is summation order, about 1e-6
    # on logits of size ~1; a dropped sliding window or another rotary setting moves them by ~1e-1.
    tolerance = 1e-5 if logits[0].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits[1], logits[0], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("model_type", list(OPTIONS))
def test_export_of_a_fine_tuned_checkpoint_replaces_it(model_type, tmp_path, tiny_corpus):
    source = tmp_path / "source"
    save_source(source, model_type, tiny_corpus)
    _, exported = fine_tuned_export(tmp_path, source, tiny_corpus)
    assert_drop_in(source, exported)


def test_the_files_are_kept_in_the_run_so_the_export_needs_no_source(tmp_path, tiny_corpus):
    """The export works from the run alone (the source directory deleted), and a run started from
    that run passes the checkpoint's files on."""
    import shutil

    source = tmp_path / "source"
    save_source(source, "mistral", tiny_corpus)
    kept = tmp_path / "kept"
    shutil.copytree(source, kept)
    run_dir, _ = fine_tuned_export(tmp_path / "first", source, tiny_corpus)
    shutil.rmtree(source)
    second, exported = fine_tuned_export(tmp_path / "second", run_dir, tiny_corpus)
    assert_drop_in(kept, exported)
    # Without a transformers source (a run started afresh in that directory) none is kept.
    from triax.runs.directory import keep_description

    keep_description(None, str(second))
    assert not (second / "init_from").exists()
