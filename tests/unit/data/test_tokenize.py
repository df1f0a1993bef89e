"""`triax tokenize`: a byte-level BPE over files, globs and URLs, written as a token directory that
decodes back to the exact text; `triax train`/`generate` use it; bad input is one line, exit 2."""

import json

import fsspec
import numpy as np
import pytest

from triax.commands.cli import main as triax_main
from triax.data import tokenize_files

from support.helpers import tiny_overrides

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install 'triax[tokenize]')")
from triax.data.tokenizer import BPETokenizer  # noqa: E402

LINES = ["First Citizen: before we proceed any further, hear me speak.", "All: speak, speak.",
         "  café — naïve ✓ 日本語 \t tabs", "", "You are all resolved rather to die than to famish?"]


@pytest.fixture
def corpus(tmp_path):
    """Two local files (one with CRLF line ends and no final newline) and one memory:// file."""
    directory = tmp_path / "text"
    directory.mkdir()
    (directory / "a.txt").write_bytes(("\n".join(LINES * 40) + "\n").encode())
    (directory / "b.txt").write_bytes("\r\n".join(reversed(LINES * 30)).encode())
    url = f"memory://triax-tokenize-{tmp_path.name}/c.txt"
    fsspec.filesystem("memory").pipe(url, ("\n".join(LINES[::2] * 50) + "\n").encode())
    texts = [(directory / "a.txt").read_bytes(), (directory / "b.txt").read_bytes(), fsspec.filesystem("memory").cat(url)]
    return [str(directory / "*.txt"), url], b"".join(texts).decode()


def read_split(out, name, dtype="uint16"):
    return np.fromfile(out / name, dtype=dtype)


def tokenize(capsys, *args):
    code = triax_main(["tokenize", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out.strip(), captured.err.strip()


def test_round_trip_and_token_counts(tmp_path, corpus, capsys):
    inputs, text = corpus
    out = tmp_path / "tokens"
    code, stdout, err = tokenize(capsys, *inputs, "--out", out, "--vocab-size", 300, "--val-fraction", 0.2)
    assert code == 0, err
    meta = json.loads((out / "meta.json").read_text())
    tokenizer = BPETokenizer.from_file(str(out / "tokenizer.json"))
    train, val = read_split(out, "train.bin"), read_split(out, "val.bin")
    assert meta == {"vocab_size": len(tokenizer), "dtype": "uint16", "tokenizer": "tokenizer.json",
                    "train_tokens": len(train), "val_tokens": len(val)}
    assert 256 < len(tokenizer) <= 300 and f"{len(train)} train + {len(val)} val tokens" in stdout
    decoded_train, decoded_val = tokenizer.decode(train), tokenizer.decode(val)
    assert decoded_train + decoded_val == text  # byte-exact: unicode, tabs, CRLF
    assert abs(len(decoded_val.encode()) / len(text.encode()) - 0.2) < 0.02  # the tail is validation
    # The chunked encoding has the token count of encoding each file whole (chunks end at line ends).
    per_file = [tokenizer.encode(part) for part in (text[:len(decoded_train)], decoded_val)]
    assert len(train) + len(val) <= sum(map(len, per_file)) + 3
    assert max(train.max(), val.max()) < len(tokenizer)


def test_small_chunks_and_a_given_tokenizer(tmp_path, corpus, capsys, monkeypatch):
    """Chunks far smaller than the text (as for inputs larger than memory), and a long line with no
    newline: still the exact text; --tokenizer reuses a tokenizer instead of training one."""
    inputs, text = corpus
    long_line = tmp_path / "long.txt"
    long_line.write_text("ünïcödé " * 300)
    assert tokenize(capsys, *inputs, "--out", tmp_path / "first", "--vocab-size", 280)[0] == 0
    monkeypatch.setattr(tokenize_files, "CHUNK_CHARACTERS", 64)
    code, _, err = tokenize(capsys, *inputs, long_line, "--out", tmp_path / "second",
                            "--tokenizer", tmp_path / "first" / "tokenizer.json")
    assert code == 0, err
    assert (tmp_path / "second" / "tokenizer.json").read_text() == (tmp_path / "first" / "tokenizer.json").read_text()
    tokenizer = BPETokenizer.from_file(str(tmp_path / "second" / "tokenizer.json"))
    ids = np.concatenate([read_split(tmp_path / "second", "train.bin"), read_split(tmp_path / "second", "val.bin")])
    assert tokenizer.decode(ids) == text + long_line.read_text()


def test_tokenized_directory_trains_and_generate_decodes(tmp_path, corpus, capsys):
    inputs, _ = corpus
    assert tokenize(capsys, *inputs, "--out", tmp_path / "tokens", "--vocab-size", 300)[0] == 0
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(run_dir, str(tmp_path / "tokens"), **{"data.task": "tokens", "trainer.max_steps": 3})
    assert triax_main(["train", *overrides]) == 0
    assert (run_dir / "tokenizer.json").read_text() == (tmp_path / "tokens" / "tokenizer.json").read_text()
    capsys.readouterr()
    assert triax_main(["generate", str(run_dir), "--prompt", "First Citizen:", "--tokens", "5", "--greedy"]) == 0
    assert capsys.readouterr().out.startswith("First Citizen:")


def bad_case(tmp_path, corpus, name):
    inputs, _ = corpus
    out = ["--out", str(tmp_path / "out")]
    if name == "missing file":
        return [str(tmp_path / "nope.txt"), *out], ["nope.txt", "does not exist"]
    if name == "glob matches nothing":
        return [str(tmp_path / "*.md"), *out], ["*.md", "matches no file"]
    if name == "directory":
        return [str(tmp_path), *out], ["is a directory"]
    if name == "not utf-8":
        (tmp_path / "latin.txt").write_bytes(b"caf\xe9 au lait\n")
        return [str(tmp_path / "latin.txt"), *out], ["latin.txt", "not UTF-8"]
    if name == "empty":
        (tmp_path / "empty.txt").write_text("")
        return [str(tmp_path / "empty.txt"), *out], ["no text"]
    if name == "tiny vocab":
        return [*inputs, *out, "--vocab-size", "10"], ["--vocab-size", "256", "10"]
    if name == "bad fraction":
        return [*inputs, *out, "--val-fraction", "1.5"], ["--val-fraction", "1.5"]
    if name == "not a number":
        return [*inputs, *out, "--vocab-size", "lots"], ["--vocab-size", "lots"]
    if name == "no out":
        return [*inputs], ["--out"]
    if name == "both vocab and tokenizer":
        return [*inputs, *out, "--vocab-size", "300", "--tokenizer", "t.json"], ["--tokenizer", "--vocab-size"]
    if name == "bad tokenizer":
        (tmp_path / "t.json").write_text('{"model": 3}')
        return [*inputs, *out, "--tokenizer", str(tmp_path / "t.json")], ["t.json", "not a valid tokenizer.json"]
    if name == "out already used":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "train.bin").write_bytes(b"")
        return [*inputs, *out], ["already holds", "--overwrite"]
    if name == "too small to split":
        (tmp_path / "one.txt").write_text("x")
        return [str(tmp_path / "one.txt"), *out], ["too small to split"]
    raise AssertionError(name)


BAD = ["missing file", "glob matches nothing", "directory", "not utf-8", "empty", "tiny vocab", "bad fraction",
       "not a number", "no out", "both vocab and tokenizer", "bad tokenizer", "out already used", "too small to split"]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_and_exit_2(tmp_path, corpus, capsys, name):
    args, words = bad_case(tmp_path, corpus, name)
    code, _, err = tokenize(capsys, *args)
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("triax: error:"), err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"
    assert not (tmp_path / "out" / "meta.json").exists()
