"""`triax tokenize --workers N --format megatron`: N processes write the very bytes one does, and the
output directory is a Megatron dataset (its .idx read by triax, and by megatron-core when installed)
with a document per input file, as well as nanoGPT's layout."""

import json
import subprocess
import sys

import numpy as np
import pytest

from triax.commands.cli import main as triax_main
from triax.data.megatron import IndexedDataset
from triax.testing import quiet_env

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install 'triax[tokenize]')")

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "naïve", "日本語", "zeta"]
OUTPUTS = ("train.bin", "val.bin", "train.idx", "val.idx", "tokenizer.json", "meta.json")


@pytest.fixture
def inputs(tmp_path):
    """8 text files of different lengths, one without a final newline."""
    rng = np.random.default_rng(0)
    directory = tmp_path / "text"
    directory.mkdir()
    for number in range(8):
        lines = [" ".join(rng.choice(WORDS, 9)) for _ in range(40 + 30 * number)]
        (directory / f"part_{number}.txt").write_text("\n".join(lines) + ("\n" if number % 3 else ""))
    return directory


def tokenize(capsys, *args):
    code = triax_main(["tokenize", *map(str, args)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


@pytest.mark.multiprocess
def test_two_workers_write_the_bytes_one_worker_writes(tmp_path, inputs, capsys, monkeypatch):
    from triax.data import tokenize_files

    monkeypatch.setattr(tokenize_files, "CHUNK_CHARACTERS", 2000)  # many chunks per file: real interleaving
    tokenize(capsys, inputs / "*.txt", "--out", tmp_path / "one", "--vocab-size", 300, "--format", "megatron")
    tokenizer = tmp_path / "one" / "tokenizer.json"
    tokenize(capsys, inputs / "*.txt", "--out", tmp_path / "one_again", "--tokenizer", tokenizer,
             "--format", "megatron")
    tokenize(capsys, inputs / "*.txt", "--out", tmp_path / "two", "--tokenizer", tokenizer, "--workers", 2,
             "--format", "megatron")
    for name in OUTPUTS:
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one_again" / name).read_bytes(), name
    assert (tmp_path / "two" / "train.bin").read_bytes() == (tmp_path / "one" / "train.bin").read_bytes()


def test_the_output_is_a_megatron_dataset_with_a_document_per_file(tmp_path, inputs, capsys):
    out = tmp_path / "out"
    tokenize(capsys, inputs / "*.txt", "--out", out, "--vocab-size", 300, "--format", "megatron",
             "--val-fraction", 0.1)
    train, val = IndexedDataset(str(out / "train")), IndexedDataset(str(out / "val"))
    # The validation tail begins inside the last file: it is cut into a train and a val document.
    assert (train.document_count, val.document_count) == (8, 1)
    meta = json.loads((out / "meta.json").read_text())
    assert (train.num_tokens, val.num_tokens) == (meta["train_tokens"], meta["val_tokens"])
    from triax.data.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.from_file(str(out / "tokenizer.json"))
    flat = np.fromfile(out / "train.bin", dtype=np.uint16)
    starts = list(train.document_starts()) + [len(flat)]
    texts = [path.read_text() for path in sorted(inputs.glob("*.txt"))]
    assert [tokenizer.decode(flat[a:b]) for a, b in zip(starts[:7], starts[1:8])] == texts[:7]
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    theirs = indexed.IndexedDataset(str(out / "train"))
    assert len(theirs.document_indices) - 1 == 8
    assert np.array_equal(np.concatenate([theirs[i] for i in range(len(theirs))]), flat)


def test_bad_worker_counts_are_one_line(tmp_path, inputs, capsys):
    for workers in ("0", "-2", "1000"):
        code = triax_main(["tokenize", str(inputs / "*.txt"), "--out", str(tmp_path / "out"), "--workers", workers])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "--workers must be 1 .. 256" in err, err


@pytest.fixture
def records(tmp_path):
    """Two JSON Lines files, a record a document (one with a blank line and unicode)."""
    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(3, 60)))) + ("\n" if number % 4 else "") for number in range(60)]
    for name, part in (("a.jsonl", texts[:35]), ("b.jsonl", texts[35:])):
        lines = [json.dumps({"id": number, "content": text}) for number, text in enumerate(part)]
        (tmp_path / name).write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    return tmp_path, texts


@pytest.mark.multiprocess
def test_json_lines_records_are_documents_and_two_workers_agree(tmp_path, records, capsys):
    directory, texts = records
    common = ["--text-field", "content", "--format", "megatron", "--val-fraction", 0.2]
    tokenize(capsys, directory / "*.jsonl", "--out", tmp_path / "one", "--vocab-size", 300, *common)
    tokenize(capsys, directory / "*.jsonl", "--out", tmp_path / "two", "--vocab-size", 300, "--workers", 2, *common)
    for name in OUTPUTS:
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    from triax.data.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.from_file(str(tmp_path / "one" / "tokenizer.json"))
    decoded = []
    for split in ("train", "val"):
        dataset = IndexedDataset(str(tmp_path / "one" / split))
        flat = np.fromfile(tmp_path / "one" / f"{split}.bin", dtype=np.uint16)
        starts = list(dataset.document_starts()) + [len(flat)]
        decoded += [tokenizer.decode(flat[a:b]) for a, b in zip(starts, starts[1:])]
    assert decoded == texts  # every record whole, in order, one document each, none cut by the split


@pytest.mark.parametrize("line, says", [
    ('{"content": "fine"', "line 2 is not JSON"),
    ('["a list"]', "line 2 is a JSON list, not an object"),
    ('{"text": "no content"}', "line 2 has no 'content' field (it has 'text'); name the text with --text-field"),
    ('{"content": 7}', "line 2: 'content' is a int, not text"),
    ('{"content": "' + "x" * 200 + '"}', "line 2 is longer than 100 characters"),
])
def test_a_bad_record_is_one_line_naming_the_file_and_line(tmp_path, capsys, monkeypatch, line, says):
    from triax.data import text_records

    monkeypatch.setattr(text_records, "MAX_LINE_CHARACTERS", 100)
    (tmp_path / "bad.jsonl").write_text('{"content": "a good first record"}\n' + line + "\n")
    code = triax_main(["tokenize", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "out"), "--text-field",
                       "content"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "bad.jsonl" in err and says in err, err


@pytest.mark.multiprocess
def test_workers_take_the_chunks_in_order_and_read_only_a_few_ahead(tmp_path, inputs):
    """The writer gets each chunk's ids in reading order, and the input is read at most IN_FLIGHT
    chunks a worker ahead of it: memory stays bounded whatever the input's size."""
    from triax.data.tokenize_parallel import IN_FLIGHT, encoded
    from triax.data.tokenizer import BPETokenizer

    tokenizer = BPETokenizer(small_tokenizer(inputs))
    read = []

    def texts():
        for number in range(40):
            read.append(number)
            yield f"chunk {number} " + " ".join(WORDS[number % len(WORDS):]) + "\n"

    for number, ids in enumerate(encoded(tokenizer, texts(), "uint16", 2)):
        assert len(read) <= number + 1 + 2 * IN_FLIGHT, (number, len(read))
        assert tokenizer.decode(ids).startswith(f"chunk {number} ")
    assert number == 39


def small_tokenizer(inputs):
    """The JSON of a 300-token BPE trained on one of the input files."""
    import fsspec

    from triax.data.tokenize_files import train_bpe

    path = str(inputs / "part_7.txt")
    return train_bpe([(fsspec.filesystem("file"), path, len(open(path).read()))], 300)


def test_an_encoding_worker_imports_no_torch(tmp_path, inputs):
    """Each worker imports only what encodes (not torch: a second and a few hundred MB a worker,
    which made two workers slower than one)."""
    (tmp_path / "tokenizer.json").write_text(small_tokenizer(inputs))
    probe = ("import sys, triax.data.tokenize_parallel as p; p._start_worker(open(sys.argv[1]).read()); "
             "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "tokenizer.json")], capture_output=True, text=True,
                            env=quiet_env(), timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_command_imports_no_torch(tmp_path, inputs):
    """`triax tokenize` of text imports no torch in its own process either: a second of start-up,
    serial before any worker starts (the run reader, which needs it, only when --out lies in a run)."""
    probe = ("import sys; from triax.commands.cli import main; code = main(sys.argv[1:]); "
             "print(code, [name for name in sys.modules if name.split('.')[0] == 'torch'][:3])")
    result = subprocess.run([sys.executable, "-c", probe, "tokenize", str(inputs / "part_0.txt"), "--out",
                             str(tmp_path / "tokens"), "--vocab-size", "300"], capture_output=True, text=True,
                            env=quiet_env(), timeout=120)
    assert result.stdout.strip().splitlines()[-1:] == ["0 []"], result.stdout + result.stderr


@pytest.mark.multiprocess
def test_a_tokenizer_failing_in_a_worker_is_the_one_line_one_worker_gives(tmp_path, inputs, capfd):
    """A pre-tokenizer whose regex gives up (a panic of the Rust library) stops the command with the
    same line, naming the tokenizer file, whether it failed here or in a worker (whose standard
    error is this process's: nothing else reaches it)."""
    tokenizer = json.loads(small_tokenizer(inputs))
    tokenizer["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated",
                                  "invert": False}
    (tmp_path / "bad.json").write_text(json.dumps(tokenizer))
    (tmp_path / "text.txt").write_text("fine words\n" * 50 + "a" * 60 + "c\n")
    lines = []
    for workers in ("1", "2"):
        code = triax_main(["tokenize", str(tmp_path / "text.txt"), "--out", str(tmp_path / f"out{workers}"),
                           "--tokenizer", str(tmp_path / "bad.json"), "--workers", workers])
        lines.append(capfd.readouterr().err.strip())
        assert code == 2 and len(lines[-1].splitlines()) == 1, lines[-1]
    assert lines[0] == lines[1] and "bad.json' failed inside the tokenizers library" in lines[0], lines
