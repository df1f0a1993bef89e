"""Chat templates and conversations for the chat tests: a Llama 3 style and a Qwen2 style template
(written here, in the form their checkpoints ship, plus `{% generation %}` tags around the answers
as transformers' assistant masks need), a tokenizer that knows their special tokens, and a
multi-turn chat file."""

import json

import pytest

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN2_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# Qwen2's own template (a default system prompt when the conversation has none) ...
QWEN2_PLAIN = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# ... and with generation tags around each answer and its end of turn.
QWEN2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You answer in one short sentence."},
                  {"role": "user", "content": "What colour is the sky?"},
                  {"role": "assistant", "content": "The sky is blue."},
                  {"role": "user", "content": "And the grass?"},
                  {"role": "assistant", "content": "The grass is green."}]},
    {"messages": [{"role": "user", "content": "Count to three."},
                  {"role": "assistant", "content": "one two three"},
                  {"role": "user", "content": "Now backwards."},
                  {"role": "assistant", "content": "three two one"}]},
    {"prompt": "Say hello.", "completion": "Hello there."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 and 3 make 5."},
    {"instruction": "Name a fruit.", "output": "An apple."},
]

CORPUS = (" ".join(json.dumps(record) for record in CONVERSATIONS) + " You are a helpful assistant. system user "
          "assistant The sky is blue. The grass is green. one two three ") * 20


def write_tokenizer(directory, special_tokens):
    """tokenizer.json trained on the conversations, with the template's special tokens."""
    from support.llama_checkpoints import train_tokenizer

    corpus = directory / "corpus.txt"
    corpus.write_text(CORPUS)
    train_tokenizer(str(corpus), directory / "tokenizer.json", special_tokens)
    corpus.unlink()


def write_chat_file(path, records=CONVERSATIONS, repeat=1):
    path.write_text("".join(json.dumps(record) + "\n" for _ in range(repeat) for record in records))
    return path


def hf_tokenizer(directory, template, bos_token=None, eos_token=None):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token=bos_token,
                                   eos_token=eos_token, chat_template=template)


def arithmetic_conversations(count, seed=0):
    """`count` short multi-turn conversations with answers a model can learn (sums in words)."""
    import random

    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b, c = rng.randrange(5), rng.randrange(5), rng.randrange(5)
        records.append({"messages": [
            {"role": "user", "content": f"{words[a]} plus {words[b]}?"},
            {"role": "assistant", "content": f"{words[a + b]}."},
            {"role": "user", "content": f"and {words[c]} plus {words[c]}?"},
            {"role": "assistant", "content": f"{words[2 * c]}."}]})
    return records


def write_chat_checkpoint(directory, model_type="llama", **options):
    """A tiny random transformers checkpoint whose tokenizer knows the Llama 3 style special tokens,
    with the Llama 3 style chat template in its tokenizer_config.json."""
    from support.llama_checkpoints import save_checkpoint
    from support.moe_checkpoints import MODEL_TYPES, save_checkpoint as save_new_family  # qwen3, mixtral, qwen3_moe

    directory.mkdir(parents=True, exist_ok=True)
    save = save_new_family if model_type in MODEL_TYPES else save_checkpoint
    model = save(directory, model_type, **{"max_position_embeddings": 128, **options})
    records = arithmetic_conversations(50)
    corpus = directory / "corpus.txt"
    corpus.write_text(CORPUS + " ".join(json.dumps(record) for record in records) * 3)
    from support.llama_checkpoints import train_tokenizer

    train_tokenizer(str(corpus), directory / "tokenizer.json", LLAMA3_SPECIAL)
    corpus.unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE}))
    return model


# ---- the chat styles the data tests run in, each with its transformers tokenizer ---------------

STYLES = {"llama3": (LLAMA3_TEMPLATE, LLAMA3_SPECIAL, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
          "qwen2": (QWEN2_TEMPLATE, QWEN2_SPECIAL, {"eos_token": "<|im_end|>"})}


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request, tmp_path_factory):
    from triax.data.chat import ChatEncoder
    from triax.data.chat_template import ChatTemplate
    from triax.data.tokenizer import BPETokenizer

    template, special, tokens = STYLES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    write_tokenizer(directory, special)
    tokenizer = BPETokenizer.from_file(str(directory / "tokenizer.json")).tokenizer
    encoder = ChatEncoder(ChatTemplate(template, request.param, tokens), tokenizer)
    return request.param, directory, encoder, hf_tokenizer(directory, template, **tokens)


def transformers_ids_and_mask(hf, messages):
    """transformers' ids and answer mask of one conversation (apply_chat_template)."""
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])
