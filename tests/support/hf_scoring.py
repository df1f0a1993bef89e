"""An evaluator independent of triax: transformers' AutoModelForCausalLM (GPT-2, Llama, Qwen2...)
scores a token sequence.

Used to check triax's own numbers (the trainer's val_loss, `triax eval`) against a model exported
with `triax export --format hf`, or an export against the checkpoint it started from. Nothing here
imports triax.
"""

import json
import os

import torch


def char_validation_ids(run_dir, corpus_path, train_split=0.9):
    """The validation split of a character run as ids of its vocab.json: the text's tail."""
    with open(os.path.join(run_dir, "vocab.json")) as handle:
        chars = json.load(handle)["chars"]
    with open(corpus_path, encoding="utf-8") as handle:
        text = handle.read()
    index = {ch: i for i, ch in enumerate(chars)}
    return torch.tensor([index[ch] for ch in text[int(len(text) * train_split):]])


@torch.no_grad()
def hf_mean_loss(model_dir, ids, block_size, tail=True, batch_size=64):
    """(mean next-token loss, tokens scored) over consecutive windows of `block_size` targets;
    with `tail`, the targets left over at the end are scored too, by a window ending at the last token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    return model_mean_loss(model, ids, block_size, tail, batch_size)


@torch.no_grad()
def model_mean_loss(model, ids, block_size, tail=True, batch_size=64):
    """hf_mean_loss of a transformers model already in memory (in eval mode)."""
    targets = len(ids) - 1
    full = targets // block_size
    windows = [(k * block_size, 0) for k in range(full)]
    leftover = targets - full * block_size
    if tail and leftover:
        windows.append((len(ids) - 1 - block_size, block_size - leftover))
    total, count = 0.0, 0
    for begin in range(0, len(windows), batch_size):
        chunk = windows[begin:begin + batch_size]
        x = torch.stack([ids[s:s + block_size] for s, _ in chunk])
        y = torch.stack([ids[s + 1:s + block_size + 1] for s, _ in chunk]).clone()
        for row, (_, skip) in enumerate(chunk):
            y[row, :skip] = -100
        logits = model(x).logits.float()
        total += torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1),
                                                   reduction="sum").item()
        count += int((y != -100).sum())
    return total / count, count


def tokenizer_validation_ids(directory, corpus, count=2000):
    """The last `count` ids of `corpus` encoded by the checkpoint `directory`'s tokenizer.json (no
    special tokens added): a validation stream the checkpoint's own tokenizer makes."""
    from tokenizers import Tokenizer

    with open(corpus, encoding="utf-8") as handle:
        text = handle.read()
    return torch.tensor(Tokenizer.from_file(str(directory / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids[-count:])
