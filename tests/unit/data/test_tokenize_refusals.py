"""`triax tokenize` on hostile input: links planted in its output, a FIFO for a tokenizer, a file
without line breaks (cut into bounded pieces, tokenized in bounded time)."""

import os

from triax.commands.cli import main as triax_main


def test_tokenize_never_writes_through_planted_links(sandbox, capsys):
    """A symlinked train.bin.tmp is replaced, not truncated through; a dangling meta.json link
    counts as an existing output (refused without --overwrite) and --overwrite replaces the link."""
    corpus = sandbox.work / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = sandbox.work / "tokens"
    out.mkdir()
    precious = sandbox.root / "precious.bin"
    precious.write_bytes(b"keep me")
    os.symlink(precious, out / "train.bin.tmp")
    os.symlink(sandbox.root / "created-outside.json", out / "meta.json")
    sandbox.refused(["tokenize", str(corpus), "--out", str(out), "--vocab-size", "280"], "meta.json", "--overwrite")
    assert triax_main(["tokenize", str(corpus), "--out", str(out), "--vocab-size", "280", "--overwrite"]) == 0
    assert precious.read_bytes() == b"keep me"
    assert not (sandbox.root / "created-outside.json").exists()
    assert not os.path.islink(out / "meta.json") and (out / "meta.json").stat().st_size > 0


def test_tokenize_with_a_fifo_tokenizer_is_refused_at_once(sandbox):
    corpus = sandbox.work / "corpus.txt"
    corpus.write_text("hello world\n" * 50)
    os.mkfifo(sandbox.work / "tok.json")
    sandbox.refused(["tokenize", str(corpus), "--out", str(sandbox.work / "tokens"), "--tokenizer",
                     str(sandbox.work / "tok.json")], "tok.json")


def test_long_lines_are_cut_and_ordinary_text_is_not():
    from triax.data.tokenize_parallel import LONGEST_PIECE, pieces

    text = "a b\nccc\n" * 10
    assert pieces(text) == text.splitlines(keepends=True)
    blob = "x y" * (30 * LONGEST_PIECE)
    assert "".join(pieces(blob)) == blob and max(map(len, pieces(blob))) <= LONGEST_PIECE


def test_tokenize_a_file_without_line_breaks(tmp_path):
    """One word of 1.2 MB: byte-level BPE on it whole takes minutes (400 KB took over a minute)."""
    import random
    import signal

    def expired(*_):
        raise TimeoutError("tokenize took over 60 s")

    blob = tmp_path / "blob.txt"
    blob.write_text("".join(random.Random(0).choices("abcdefghij", k=1_200_000)))
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    try:
        assert triax_main(["tokenize", str(blob), "--out", str(tmp_path / "t"), "--vocab-size", "300"]) == 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_an_input_that_is_a_fifo_or_a_device_is_named_as_such(sandbox):
    """Not 'does not exist': the path is there, but it has no end to read to."""
    os.mkfifo(sandbox.work / "pipe.txt")
    for name in (str(sandbox.work / "pipe.txt"), "/dev/zero"):
        sandbox.refused(["tokenize", name, "--out", str(sandbox.work / "tokens"), "--vocab-size", "280",
                         "--workers", "2"], name, "not a regular file")
