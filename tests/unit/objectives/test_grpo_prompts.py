"""GRPO's prompt records: the ids of every prompt equal those TRL's GRPOTrainer makes of it (its own
_tokenize_prompts, text and conversational), the records' other fields reach the rewards by name,
JSONL, JSON and Parquet read alike, and bad records are one line naming the file, line and field."""

import json
import os
from types import SimpleNamespace

import pytest

from support.chat_files import write_chat_checkpoint
from triax.data.chat import RecordError
from triax.data.errors import DataError
from triax.data.tokenizer import BPETokenizer
from triax.objectives.grpo.prompts import load_prompt_datasets, prompt_encoder_for

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'triax[test]')")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def records(count, conversational):
    out = []
    for number in range(count):
        a, b = number % 5, (number * 3) % 5
        question = f"{WORDS[a]} plus {WORDS[b]}?"
        prompt = ([{"role": "system", "content": "Add."}, {"role": "user", "content": question}]
                  if conversational else question)
        out.append({"prompt": prompt, "answer": WORDS[a + b], "level": number % 3})
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo") / "base"
    write_chat_checkpoint(directory)
    return directory


def encoder_of(directory):
    from triax.interop.hf.files import description_files

    tokenizer = BPETokenizer.from_file(str(directory / "tokenizer.json")).tokenizer
    return prompt_encoder_for(None, description_files(str(directory)), str(directory), tokenizer)


def write(path, items):
    if str(path).endswith(".json"):
        path.write_text(json.dumps(items))
    elif str(path).endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet as parquet

        parquet.write_table(pyarrow.Table.from_pylist(items), str(path))
    else:
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return str(path)


def trl_ids(directory, prompts):
    """TRL's GRPOTrainer._tokenize_prompts on a stand-in trainer holding the checkpoint's tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    stand_in = SimpleNamespace(processing_class=tokenizer, _is_vlm=False, environment_factories=None, tools=None,
                               chat_template=None, chat_template_kwargs={})
    return [list(ids) for ids in GRPOTrainer._tokenize_prompts(stand_in, prompts)[0]]


@pytest.mark.parametrize("conversational", [False, True], ids=["text", "conversational"])
def test_ids_equal_trl_for_every_prompt(checkpoint, tmp_path, conversational):
    items = records(12, conversational)
    path = write(tmp_path / "prompts.jsonl", items)
    data = load_prompt_datasets(path, None, 0.75, encoder_of(checkpoint), block_size=96, max_completion_length=16)
    ours = [prompt.ids for prompt in data.train.prompts + data.val.prompts]
    assert ours == trl_ids(checkpoint, [item["prompt"] for item in items])
    assert (len(data.train), len(data.val)) == (9, 3)
    assert data.report == "prompt data: 9 training / 3 validation prompts; 0 left out (longer than 80 tokens)"


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_every_file_form_gives_the_same_prompts_and_columns(checkpoint, tmp_path, suffix):
    items = records(6, conversational=True)
    items[2].pop("level")  # a record without a field: None for it, as a table would hold
    data = load_prompt_datasets(write(tmp_path / f"prompts{suffix}", items), None, 0.5, encoder_of(checkpoint), 96, 16)
    assert data.train.column_names == ["answer", "level"]
    picked = data.train.records([2, 0])
    assert [prompt.prompt for prompt in picked] == [items[2]["prompt"], items[0]["prompt"]]
    assert data.train.columns(picked, repeat=2) == {"answer": ["three", "three", "zero", "zero"],
                                                     "level": [None, None, 0, 0]}


def test_prompts_with_no_room_for_a_completion_are_left_out(checkpoint, tmp_path):
    items = records(6, conversational=False)
    items[1]["prompt"] = " ".join(WORDS * 6)
    data = load_prompt_datasets(write(tmp_path / "p.jsonl", items), None, 0.5, encoder_of(checkpoint), 40, 16)
    assert len(data.train) + len(data.val) == 5 and "1 left out (longer than 24 tokens)" in data.report
    with pytest.raises(DataError, match="leaves no room for a prompt"):
        load_prompt_datasets(write(tmp_path / "q.jsonl", items), None, 0.5, encoder_of(checkpoint), 16, 16)


BAD_RECORDS = {
    '"just text"': "p.jsonl:2: a record must be a JSON object, got str",
    '{"question": "x"}': "p.jsonl:2: a prompt record needs field 'prompt' (text or a list of messages); it has question",
    '{"prompt": 7}': "p.jsonl:2: field 'prompt' must be text, got int",
    '{"prompt": "  "}': "p.jsonl:2: field 'prompt' is empty",
    '{"prompt": []}': "p.jsonl:2: field 'prompt' must be a non-empty list",
    '{"prompt": [{"role": "robot", "content": "x"}]}': "p.jsonl:2: field 'prompt[0].role' is 'robot'",
    '{"prompt": [{"role": "user", "content": 3}]}': "p.jsonl:2: field 'prompt[0].content' must be text, got int",
    '{"prompt": "x", "completions": 1}': "p.jsonl:2: field 'completions' has the name of an argument",
    '{"prompt": "\\ud800"}': "p.jsonl:2: field 'prompt' is not valid text (a lone surrogate",
    '{"prompt": "x", "a": [[[[[[[[[1]]]]]]]]]}': "p.jsonl:2: the record nests more than 8 levels deep",
    '{"prompt": NaN}': "p.jsonl:2: not valid JSON",
    '{"prompt": "x"': "p.jsonl:2: not valid JSON",
}


@pytest.mark.parametrize("line", sorted(BAD_RECORDS))
def test_a_bad_record_is_one_line_naming_file_line_and_field(checkpoint, tmp_path, line):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one plus one?"}\n' + line + "\n")
    with pytest.raises(RecordError) as caught:
        load_prompt_datasets(str(path), None, 0.5, encoder_of(checkpoint), 96, 16)
    assert str(caught.value).startswith(str(tmp_path / BAD_RECORDS[line])) and "\n" not in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_hostile_files_are_one_line(checkpoint, tmp_path):
    good = write(tmp_path / "good.jsonl", records(4, False))
    os.symlink(good, tmp_path / "link.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (tmp_path / "p.txt").write_text("x")
    cases = {"link.jsonl": "is a symlink", "fifo.jsonl": "not a regular file", "missing.jsonl": "does not exist",
             "latin.jsonl": "not UTF-8 text", "p.txt": "is not .jsonl, .json or .parquet"}
    for name, message in cases.items():
        with pytest.raises(DataError) as caught:
            load_prompt_datasets(str(tmp_path / name), None, 0.5, encoder_of(checkpoint), 96, 16)
        assert message in str(caught.value) and "\n" not in str(caught.value), (name, str(caught.value))
    with pytest.raises(DataError, match="data.task=grpo needs data.path"):
        load_prompt_datasets(None, None, 0.5, encoder_of(checkpoint), 96, 16)


def test_a_conversational_prompt_without_a_template_is_one_line(checkpoint, tmp_path):
    from triax.objectives.grpo.prompts import PromptEncoder

    encoder = PromptEncoder(encoder_of(checkpoint).tokenizer, None, "the checkpoint has no chat template")
    path = write(tmp_path / "p.jsonl", records(4, conversational=True))
    with pytest.raises(DataError, match=r"p.jsonl:1: a conversational prompt needs a chat template: the checkpoint"):
        load_prompt_datasets(path, None, 0.5, encoder, 96, 16)
    text = load_prompt_datasets(write(tmp_path / "t.jsonl", records(4, False)), None, 0.5, encoder, 96, 16)
    assert len(text.train) == 2


def copy_checkpoint(checkpoint, tmp_path, generation_config):
    import shutil

    directory = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
    shutil.copytree(checkpoint, directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (directory / "generation_config.json").write_text(generation_config)
    return directory


@pytest.mark.parametrize("eos_token_id", [7, [7, 9]])
def test_a_completion_also_ends_where_generation_config_says(checkpoint, tmp_path, eos_token_id):
    """generation_config.json's eos_token_id (one id or several, as Llama 3 and Qwen2.5 instruct
    checkpoints name them) ends a completion too, as transformers' generate ends TRL's; the
    tokenizer's eos stays first (it pads the completions that ended)."""
    from triax.objectives.grpo.build import stop_ids

    plain = stop_ids(SimpleNamespace(encoder=encoder_of(copy_checkpoint(checkpoint, tmp_path, None))))
    directory = copy_checkpoint(checkpoint, tmp_path, json.dumps({"eos_token_id": eos_token_id}))
    ends = stop_ids(SimpleNamespace(encoder=encoder_of(directory)))
    extra = sorted(set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]) - set(plain))
    assert extra and ends == plain + tuple(extra)


@pytest.mark.parametrize("text, words", [
    ('{"eos_token_id": "7"}', "eos_token_id=['7'] must be a token id"),
    ('{"eos_token_id": -1}', "eos_token_id=[-1] must be a token id"),
    ('{"eos_token_id": 10000000}', "eos_token_id=[10000000] must be a token id"),
    ('{"eos_token_id": true}', "eos_token_id=[True] must be a token id"),
    ('{"eos_token_id": [' + ", ".join(["1"] * 65) + ']}', "a list of at most 64"),
    ('{"eos_token_id": ', "cannot read"),
    ('[1, 2]', "cannot read"),
])
def test_a_generation_config_that_lies_is_one_line(checkpoint, tmp_path, text, words):
    directory = copy_checkpoint(checkpoint, tmp_path, text)
    with pytest.raises(DataError) as caught:
        encoder_of(directory)
    message = str(caught.value)
    assert words in message and "generation_config.json" in message and "\n" not in message
