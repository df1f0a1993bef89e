"""data.task=preference: the prompt, chosen and rejected ids of every pair equal those TRL's
DPOTrainer makes of the same file (conversational and text records, explicit and implicit
prompts), cut to max_length as TRL's collator cuts them; JSONL, JSON and Parquet read alike; bad
records and files refused in one line naming the file, the line and the field."""

import json
import os

import pytest
import torch

from support.chat_files import write_chat_checkpoint
from support.preference_files import preference_records, write_preference_file
from triax.data.targets import IGNORE_INDEX
from triax.data.chat import RecordError, read_records
from triax.data.chat_template import TemplateError
from triax.data.errors import DataError
from triax.data.preference import (PreferenceDataset, encode_pairs, load_preference_datasets,
                                   preference_encoder_for)
from triax.data.tokenizer import BPETokenizer

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'triax[test]')")
datasets = pytest.importorskip("datasets")

FORMS = ["conversational", "conversational-implicit", "standard", "standard-implicit"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("preference") / "base"
    write_chat_checkpoint(directory)
    return directory


def encoder_of(directory):
    from triax.interop.hf.files import description_files

    tokenizer = BPETokenizer.from_file(str(directory / "tokenizer.json")).tokenizer
    return preference_encoder_for(None, description_files(str(directory)), str(directory), tokenizer)


def trl_trainer(directory, records, max_length=None, truncation_mode="keep_start"):
    """TRL's DPOTrainer on the records: its train_dataset holds the ids it trains on."""
    import warnings

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.DPOConfig(output_dir=str(directory.parent / "trl-out"), report_to=[], max_length=max_length,
                             truncation_mode=truncation_mode, use_cpu=True, precompute_ref_log_probs=False)
        return trl.DPOTrainer(model=model, args=args,
                              train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer)


@pytest.mark.parametrize("form", FORMS)
def test_ids_equal_trl_for_every_pair(checkpoint, tmp_path, form):
    records = preference_records(24, form, seed=3)
    path = write_preference_file(tmp_path / "pairs.jsonl", records)
    split = encode_pairs(read_records(str(path)), encoder_of(checkpoint), max_length=2**30, truncation="keep_start")
    theirs = trl_trainer(checkpoint, records).train_dataset
    assert len(split.pairs) == len(theirs) == 24
    for pair, row in zip(split.pairs, theirs):
        assert (pair.prompt, pair.chosen, pair.rejected) == (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
        assert pair.prompt and pair.chosen and pair.chosen != pair.rejected  # the comparison means something


@pytest.mark.parametrize("truncation", ["keep_start", "keep_end"])
def test_rows_are_trl_collator_rows_cut_to_max_length(checkpoint, tmp_path, truncation):
    """max_length shorter than many sequences: the same pairs left out (keep_start, prompt fills the
    block), and each batch's rows are TRL's collator's input_ids, with targets where its completion
    mask is set on the next token."""
    records = preference_records(24, "conversational-implicit", seed=4)
    max_length = 50  # prompts are 43-46 tokens, answers 4-13: many sequences are cut
    path = write_preference_file(tmp_path / "pairs.jsonl", records)
    split = encode_pairs(read_records(str(path)), encoder_of(checkpoint), max_length, truncation)
    trainer = trl_trainer(checkpoint, records, max_length=max_length, truncation_mode=truncation)
    theirs = trainer.train_dataset
    assert len(split.pairs) == len(theirs) and split.truncated > 0
    dataset = PreferenceDataset(split.pairs, max_length, truncation)
    for start in range(0, len(theirs), 4):
        indices = list(range(start, min(start + 4, len(theirs))))
        batch = trainer.data_collator([theirs[i] for i in indices])
        x, y = dataset.batch(indices)
        ids, completion = batch["input_ids"], batch["completion_mask"]
        width = ids.size(1) - 1
        assert x.shape == (2 * len(indices), width)
        real = batch["attention_mask"][:, 1:].bool()  # the inputs that have a next token
        assert torch.equal(x[real], ids[:, :-1][real])
        expected = ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE_INDEX)
        assert torch.equal(y, expected)


def test_keep_start_leaves_out_pairs_whose_prompt_fills_the_block(checkpoint, tmp_path):
    records = preference_records(8, "conversational-implicit")
    path = write_preference_file(tmp_path / "pairs.jsonl", records)
    split = encode_pairs(read_records(str(path)), encoder_of(checkpoint), 8, "keep_start")
    assert split.dropped == 8 and not split.pairs
    assert len(trl_trainer(checkpoint, records, max_length=8).train_dataset) == 0


def test_jsonl_json_and_parquet_give_the_same_pairs(checkpoint, tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    records = preference_records(10, "conversational")
    encoder = encoder_of(checkpoint)
    jsonl = write_preference_file(tmp_path / "pairs.jsonl", records)
    as_json = write_preference_file(tmp_path / "pairs.json", records)
    parquet.write_table(pyarrow.Table.from_pylist(records), tmp_path / "pairs.parquet")
    found = [encode_pairs(read_records(str(path)), encoder, 512, "keep_start").pairs
             for path in (jsonl, as_json, tmp_path / "pairs.parquet")]
    assert found[0] == found[1] == found[2] and len(found[0]) == 10


def test_tokenize_preference_writes_trl_ids(checkpoint, tmp_path, capsys):
    """`triax tokenize --preference CHECKPOINT FILE --out DIR`: {train,val}.pairs.jsonl hold each
    pair's prompt_ids, chosen_ids and rejected_ids (TRL's names and values); val is the tail."""
    from triax.commands.cli import main

    records = preference_records(20, "conversational", seed=5)
    path = write_preference_file(tmp_path / "pairs.jsonl", records)
    out = tmp_path / "tokens"
    assert main(["tokenize", "--preference", str(checkpoint), str(path), "--out", str(out),
                 "--val-fraction", "0.2"]) == 0
    found = [json.loads(line) for split in ("train", "val") for line in open(out / f"{split}.pairs.jsonl")]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_pairs"] == 16 and meta["val_pairs"] == 4
    theirs = trl_trainer(checkpoint, records).train_dataset
    assert found == [{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in theirs]
    capsys.readouterr()
    assert main(["tokenize", "--preference", str(checkpoint), str(path), "--out", str(out)]) != 0
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "already holds" in error


GOOD = {"prompt": [{"role": "user", "content": "one plus one?"}], "chosen": [{"role": "assistant", "content": "two."}],
        "rejected": [{"role": "assistant", "content": "three."}]}
BAD_RECORDS = [
    ("[1, 2]", "record must be a JSON object"),
    ('{"prompt": "q", "chosen": "a"}', "'chosen' and 'rejected'"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "'chosen' and 'rejected'"),
    ('{"prompt": "q", "chosen": "a", "rejected": 5}', "'rejected'"),
    ('{"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}', "'rejected'"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": []}', "'chosen'"),
    ('{"prompt": [{"role": "wizard", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}], '
     '"rejected": [{"role": "assistant", "content": "b"}]}', "'prompt[0].role'"),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": 7}], "rejected": '
     '[{"role": "assistant", "content": "b"}]}', "'chosen[0].content'"),
    ('{"chosen": "", "rejected": "b"}', "'chosen'"),
    ('{"chosen": ' + "[" * 50 + "]" * 50 + ', "rejected": "b"}', "nests more than"),
    ("[" * 100000 + "]" * 100000, "nests too deeply"),
    ('{"chosen": NaN, "rejected": "b"}', "not valid JSON"),
    ("{not json", "not valid JSON"),
]


@pytest.mark.parametrize("line, named", BAD_RECORDS, ids=range(len(BAD_RECORDS)))
def test_a_bad_record_is_one_line_naming_file_line_and_field(checkpoint, tmp_path, line, named):
    path = tmp_path / "pairs.jsonl"
    good = json.dumps(GOOD)
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(RecordError) as caught:
        encode_pairs(read_records(str(path)), encoder_of(checkpoint), 512, "keep_start")
    message = str(caught.value)
    assert "\n" not in message and f"{path}:3:" in message and named in message


def test_hostile_files_and_templates_are_refused_in_one_line(checkpoint, tmp_path):
    from triax.interop.hf.files import description_files

    encoder = encoder_of(checkpoint)
    good = write_preference_file(tmp_path / "good.jsonl", [GOOD])
    cases = {}
    os.symlink(good, tmp_path / "link.jsonl")
    cases["link.jsonl"] = "symlink"
    os.mkfifo(tmp_path / "fifo.jsonl")
    cases["fifo.jsonl"] = "not a regular file"
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9", "chosen": "x", "rejected": "y"}\n')
    cases["latin.jsonl"] = "not UTF-8"
    (tmp_path / "pairs.csv").write_text("a,b\n")
    cases["pairs.csv"] = "not .jsonl"
    (tmp_path / "dict.json").write_text(json.dumps(GOOD))
    cases["dict.json"] = "holds a list"
    cases["missing.jsonl"] = "does not exist"
    (tmp_path / "long.jsonl").write_bytes(b'{"chosen": "' + b"a" * (17 * 2**20) + b'"}\n')
    cases["long.jsonl"] = "longer than"
    for name, expected in cases.items():
        with pytest.raises(DataError) as caught:
            load_preference_datasets(str(tmp_path / name), None, 0.5, encoder, 512, "keep_start")
        assert "\n" not in str(caught.value) and expected in str(caught.value), name
    with pytest.raises(DataError, match="needs data.path"):
        load_preference_datasets(None, None, 0.5, encoder, 512, "keep_start")
    # A bad validation file is named as the option it came from, not as data.path.
    with pytest.raises(DataError) as caught:
        load_preference_datasets(str(good), str(tmp_path / "pairs.csv"), 0.5, encoder, 512, "keep_start")
    assert "data.val_path" in str(caught.value) and "data.path" not in str(caught.value).replace("data.val_path", "")
    # A template that reaches for CPython internals is refused when the checkpoint is opened.
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    (hostile / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|eot_id|>", "chat_template": "{{ cycler.__init__.__globals__ }}"}))
    tokenizer = BPETokenizer.from_file(str(hostile / "tokenizer.json")).tokenizer
    with pytest.raises(TemplateError) as caught:
        encoder = preference_encoder_for(None, description_files(str(hostile)), str(hostile), tokenizer)
        encode_pairs([("x:1", GOOD)], encoder, 512, "keep_start")
    assert "\n" not in str(caught.value) and "sandbox" in str(caught.value)
    # Without a template, text records still encode; a conversational one says what is missing.
    (hostile / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    encoder = preference_encoder_for(None, description_files(str(hostile)), str(hostile), tokenizer)
    assert encode_pairs([("x:1", preference_records(1, "standard")[0])], encoder, 512, "keep_start").pairs
    with pytest.raises(DataError, match="need a chat template"):
        encode_pairs([("x:1", GOOD)], encoder, 512, "keep_start")
