"""Write a tiny random Llama checkpoint that can chat (its output layer scaled as a trained model's):
save_pretrained's files, a byte-level BPE tokenizer.json that knows Llama 3's header and end-of-turn
tokens, and a tokenizer_config.json with a Llama 3 style chat template (its answers marked by
{% generation %} tags). Also writes a JSONL file of small multi-turn conversations to fine-tune it on
(and, with --pairs, preference pairs for DPO: a sum's right answer chosen, a wrong one rejected;
docs/preference.md; with --prompts, prompt records with the sum's answer for GRPO: docs/grpo.md). A stand-in for a downloaded instruct
model (Llama 3.x Instruct, SmolLM2-Instruct, Qwen2.5-Instruct) on a CPU, nothing downloaded
(docs/chat-lora.md).

    python examples/tiny_chat_llama.py path/to/chat-llama --conversations chat.jsonl
    python examples/tiny_chat_llama.py path/to/chat-llama --conversations chat.jsonl --pairs pairs.jsonl
    python examples/tiny_chat_llama.py path/to/chat-llama --conversations chat.jsonl --prompts prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import torch

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# A freshly initialised output layer (std 0.02) gives logits within about +-1.3 after the final norm:
# no token can get much more than 1% probability, so no LoRA on the blocks could show learning (the
# loss stayed at 4.5-4.7 over 300 steps). A trained model's output layer is an order of magnitude
# larger; so is this stand-in's, and its LoRA run learns the conversations within the page's steps.
OUTPUT_STD = 0.25
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def conversations(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b, c = rng.randrange(5), rng.randrange(5), rng.randrange(5)
        records.append({"messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"{WORDS[a]} plus {WORDS[b]}?"},
            {"role": "assistant", "content": f"{WORDS[a + b]}."},
            {"role": "user", "content": f"and {WORDS[c]} plus {WORDS[c]}?"},
            {"role": "assistant", "content": f"{WORDS[2 * c]}."}]})
    return records


def preference_pairs(count: int, seed: int = 1) -> list[dict]:
    """TRL's conversational preference records: a question, the right sum chosen, a wrong one rejected."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randrange(5), rng.randrange(5)
        wrong = (a + b + rng.randrange(1, 5)) % 10
        records.append({"prompt": [{"role": "system", "content": "You add numbers."},
                                   {"role": "user", "content": f"{WORDS[a]} plus {WORDS[b]}?"}],
                        "chosen": [{"role": "assistant", "content": f"{WORDS[a + b]}."}],
                        "rejected": [{"role": "assistant", "content": f"{WORDS[wrong]}."}]})
    return records


def grpo_prompts(count: int, seed: int = 2) -> list[dict]:
    """TRL's conversational prompt-only records, each with the sum's answer (for exact_match)."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randrange(5), rng.randrange(5)
        records.append({"prompt": [{"role": "user", "content": f"{WORDS[a]} plus {WORDS[b]}?"}],
                        "answer": f"{WORDS[a + b]}."})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write the checkpoint")
    parser.add_argument("--conversations", required=True, help="the JSONL file of conversations to write")
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--pairs", default=None, help="also write this JSONL file of preference pairs (DPO)")
    parser.add_argument("--prompts", default=None, help="also write this JSONL file of prompts with answers (GRPO)")
    args = parser.parse_args()
    if args.prompts:
        with open(args.prompts, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in grpo_prompts(args.count))
    pairs = preference_pairs(args.count) if args.pairs else []
    if args.pairs:
        with open(args.pairs, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in pairs)

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    records = conversations(args.count)
    with open(args.conversations, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as corpus:
        corpus.write("\n".join(" ".join(m["content"] for m in r["messages"]) for r in records) + " system user assistant")
    tokenizer.train([corpus.name], trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.unlink(corpus.name)
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=176,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    os.makedirs(args.directory, exist_ok=True)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, OUTPUT_STD)
    model.save_pretrained(args.directory)
    tokenizer.save(os.path.join(args.directory, "tokenizer.json"))
    with open(os.path.join(args.directory, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE}, handle, indent=1)
    written = [f"{len(records)} conversations to {args.conversations}"]
    if args.pairs:
        written.append(f"{len(pairs)} preference pairs to {args.pairs}")
    if args.prompts:
        written.append(f"{args.count} prompts with their answers to {args.prompts}")
    print(f"wrote a random llama of {sum(p.numel() for p in model.parameters()):,} parameters with a chat template "
          f"to {args.directory}; {'; '.join(written)}")


if __name__ == "__main__":
    main()
