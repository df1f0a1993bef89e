"""data.task=chat: tokens and answer masks equal transformers' apply_chat_template(...,
return_assistant_tokens_mask=True), padded and packed; hostile templates and records refused in
one line."""

import json

import numpy as np
import pytest
import torch

from support.chat_files import (CONVERSATIONS, LLAMA3_TEMPLATE, QWEN2_PLAIN, style,  # noqa: F401  (style: a fixture)
                                transformers_ids_and_mask, write_chat_file)
from triax.data.targets import IGNORE_INDEX
from triax.data.chat import (ChatDataset, ChatEncoder, RecordError, encode_records, read_records, record_messages,
                             shifted)
from triax.data.chat_template import ChatTemplate, TemplateError
from triax.data.errors import DataError

pytest.importorskip("transformers")

# The templates as their checkpoints ship them, without generation tags.
PLAIN = {"llama3": LLAMA3_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
         "qwen2": QWEN2_PLAIN}


def test_tokens_and_masks_equal_transformers(style, tmp_path):
    name, _, encoder, hf = style
    path = write_chat_file(tmp_path / "chat.jsonl")
    for where, record in read_records(str(path)):
        messages = record_messages(record, where)
        example = encoder.encode(messages, where)
        ids, mask = transformers_ids_and_mask(hf, messages)
        assert example.ids == ids, where
        assert example.mask == mask, where
        assert sum(mask) > 0 and 0 in mask  # the test means something: answers and prompts both present
        # Every answer is inside the masked tokens, its end-of-turn marker included.
        answered = hf.decode([i for i, m in zip(ids, mask) if m])
        assert all(m["content"].strip() in answered for m in messages if m["role"] == "assistant")
        assert ("<|eot_id|>" if name == "llama3" else "<|im_end|>") in answered


def test_template_without_generation_tags_finds_the_same_answers(style, tmp_path):
    """The templates as shipped (no tags): answers found by rendering prefixes equal the tagged
    template's masks, which equal transformers'."""
    name, directory, encoder, hf = style
    plain = ChatEncoder(ChatTemplate(PLAIN[name], f"{name} plain", encoder.template.special_tokens), encoder.tokenizer)
    assert not plain.template.has_generation_tags
    for number, record in enumerate(CONVERSATIONS):
        messages = record_messages(record, str(number))
        assert plain.encode(messages, str(number)) == encoder.encode(messages, str(number))


@pytest.mark.parametrize("packing", [False, True])
def test_rows_hold_transformers_tokens_and_masks(style, tmp_path, packing):
    """Padded and packed rows: each example's inputs are transformers' ids less the last, its
    targets the next id where transformers' mask is set, IGNORE_INDEX elsewhere; nothing else
    has a target."""
    _, _, encoder, hf = style
    path = write_chat_file(tmp_path / "chat.jsonl", repeat=3)
    split = encode_records(read_records(str(path)), encoder, block_size=256, overlong="truncate")
    dataset = ChatDataset(split.examples, 256, packing=packing)
    assert (len(dataset) < len(split.examples)) == packing
    x, y = dataset.batch(torch.arange(len(dataset)))
    documents = dataset.document_ids(torch.arange(len(dataset)))
    found = []
    for row in range(len(dataset)):
        for document in range(int(documents[row].max()) + 1):
            where = documents[row] == document
            found.append((x[row][where].tolist(), y[row][where].tolist()))
        assert (y[row][documents[row] == -1] == IGNORE_INDEX).all()
    expected = []
    for where, record in read_records(str(path)):
        ids, mask = transformers_ids_and_mask(hf, record_messages(record, where))
        expected.append((ids[:-1], [i if m else IGNORE_INDEX for i, m in zip(ids[1:], mask[1:])]))
    assert found == expected


def test_overlong_examples_are_cut_or_dropped_and_counted(style, tmp_path):
    _, _, encoder, _ = style
    path = write_chat_file(tmp_path / "chat.jsonl")
    lengths = [len(encoder.encode(record_messages(r, "r"), "r").ids) for r in CONVERSATIONS]
    block = sorted(lengths)[2]  # some fit, some do not
    cut = encode_records(read_records(str(path)), encoder, block, "truncate")
    dropped = encode_records(read_records(str(path)), encoder, block, "drop")
    longer = sum(length > block + 1 for length in lengths)
    assert longer > 0
    assert dropped.dropped == longer and len(dropped.examples) == len(lengths) - longer
    assert cut.truncated + cut.dropped == longer
    assert all(len(example.ids) <= block + 1 for example in cut.examples)


# ---- hostile templates and records ------------------------------------------------------------

HOSTILE_TEMPLATES = [
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self.__init__.__globals__ }}",
    "{% import 'os' as os %}{{ os }}",
    "{% include '/etc/passwd' %}",
    "{% extends '/etc/passwd' %}",
    "{{ messages.append({'role': 'user'}) }}",
    "{% set ns = namespace(_secret=1) %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}{{ 'x' * 100 }}{% endfor %}{% endfor %}",
    "{% macro loop() %}{{ loop() }}{% endmacro %}{{ loop() }}",
    "{{ raise_exception('refused') }}",
    "{% for %}",
    "x" * (300 * 1024),
]


@pytest.mark.parametrize("source", HOSTILE_TEMPLATES, ids=range(len(HOSTILE_TEMPLATES)))
def test_hostile_templates_are_refused_in_one_line(source, tmp_path):
    with pytest.raises(TemplateError) as caught:
        ChatTemplate(source, "evil").render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}])
    message = str(caught.value)
    assert "\n" not in message and "evil" in message and len(message) < 600
    assert isinstance(caught.value, ValueError)  # the built-in class a user catches


BAD_RECORDS = [
    ("[1, 2]", "record must be a JSON object"),
    ('{"messages": "hi"}', "'messages'"),
    ('{"messages": []}', "'messages'"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "'messages[0].role'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "'messages[0].content'"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant message"),
    ('{"prompt": "q"}', "'completion'"),
    ('{"instruction": ["x"], "output": "y"}', "'instruction'"),
    ('{"text": "plain"}', "needs field"),
    ('{"messages": ' + "[" * 50 + "]" * 50 + "}", "nests more than"),
    ("[" * 100000 + "]" * 100000, "nests too deeply"),
    ('{"messages": NaN}', "not valid JSON"),
    ("{not json", "not valid JSON"),
]


@pytest.mark.parametrize("line, named", BAD_RECORDS, ids=range(len(BAD_RECORDS)))
def test_a_bad_record_is_one_line_naming_file_line_and_field(tmp_path, line, named):
    path = tmp_path / "chat.jsonl"
    good = json.dumps(CONVERSATIONS[0])
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(RecordError) as caught:
        for where, record in read_records(str(path)):
            record_messages(record, where)
    message = str(caught.value)
    assert "\n" not in message and f"{path}:3:" in message and named in message


def test_hostile_files_are_refused_in_one_line(tmp_path):
    import os

    good = write_chat_file(tmp_path / "good.jsonl")
    cases = {}
    os.symlink(good, tmp_path / "link.jsonl")
    cases["link.jsonl"] = "symlink"
    os.mkfifo(tmp_path / "fifo.jsonl")
    cases["fifo.jsonl"] = "not a regular file"
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9", "completion": "x"}\n')
    cases["latin.jsonl"] = "not UTF-8"
    (tmp_path / "data.csv").write_text("a,b\n")
    cases["data.csv"] = "not .jsonl"
    (tmp_path / "dict.json").write_text('{"messages": []}')
    cases["dict.json"] = "holds a list"
    cases["missing.jsonl"] = "does not exist"
    (tmp_path / "long.jsonl").write_bytes(b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}\n')
    cases["long.jsonl"] = "longer than"
    for name, expected in cases.items():
        with pytest.raises(DataError) as caught:
            for where, record in read_records(str(tmp_path / name)):
                record_messages(record, where)
        assert "\n" not in str(caught.value) and expected in str(caught.value), name
    with pytest.raises(DataError, match="local files only"):
        list(read_records("https://example.com/chat.jsonl"))


def test_json_and_shifted_targets(tmp_path, style):
    _, _, encoder, _ = style
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(CONVERSATIONS))
    records = list(read_records(str(path)))
    assert [record for _, record in records] == CONVERSATIONS
    example = encoder.encode(record_messages(records[0][1], records[0][0]), "r")
    inputs, targets = shifted(example)
    assert np.array_equal(inputs, example.ids[:-1])
    assert [t != IGNORE_INDEX for t in targets] == [bool(m) for m in example.mask[1:]]


def test_packed_rows_give_each_example_the_loss_it_has_alone(style, tmp_path):
    """A tiny Llama scores the packed rows, the padded rows and each example alone: the same loss
    on every answer token (attention and rotary positions confined to each example)."""
    import torch.nn.functional as F

    from triax.models import GPTConfig, build_model

    _, _, encoder, _ = style
    path = write_chat_file(tmp_path / "chat.jsonl", repeat=2)
    split = encode_records(read_records(str(path)), encoder, block_size=256, overlong="truncate")
    vocab = encoder.tokenizer.get_vocab_size()
    torch.manual_seed(0)
    model = build_model(GPTConfig(arch="llama", vocab_size=vocab, block_size=256, n_layer=2, n_head=4, n_kv_head=2,
                                  n_embd=32, intermediate_size=64, dropout=0.0)).eval()

    def token_losses(dataset):
        rows = torch.arange(len(dataset))
        x, y = dataset.batch(rows)
        documents = dataset.document_ids(rows) if dataset.packing else None
        with torch.no_grad():
            logits = model(x, documents=documents)
        losses = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
        return losses[y.reshape(-1) != IGNORE_INDEX]

    packed, padded = ChatDataset(split.examples, 256, True), ChatDataset(split.examples, 256, False)
    assert len(packed) < len(padded)
    alone = torch.cat([token_losses(ChatDataset([example], len(example.ids) - 1, False)) for example in split.examples])
    torch.testing.assert_close(token_losses(padded), alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(token_losses(packed), alone, atol=1e-5, rtol=1e-5)
    # Without the confinement the packed rows' later examples see the earlier ones: a different loss.
    x, y = packed.batch(torch.arange(len(packed)))
    with torch.no_grad():
        leaky = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    assert (leaky[y.reshape(-1) != IGNORE_INDEX] - alone).abs().max() > 1e-3
