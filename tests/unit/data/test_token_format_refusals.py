"""Hostile token files: a Megatron .idx that lies (magic, version, dtype code, counts against its
size, offsets, the .bin's size, the document index), a shard header with the wrong magic, version
or count, links, FIFOs, a glob that matches nothing, a source shorter than a window. Each is
refused with one line naming the file."""

import os
import struct

import numpy as np
import pytest

from triax.commands.cli import main as triax_main
from triax.data.errors import DataError
from triax.data.sources import open_source
from triax.errors import TriaxError

from support.token_formats import write_megatron, write_shard

VOCAB = 61
TOKENS = (np.arange(400) % VOCAB).astype(np.uint16)
DOCUMENTS = [TOKENS[:150], TOKENS[150:300], TOKENS[300:]]
HEADER = 34  # magic 9, version 8, dtype code 1, sequence count 8, document-index entries 8


def opened(path):
    return open_source(str(path), None, 16, VOCAB, None, 0.9)


def patched(path, offset, data):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


@pytest.fixture
def prefix(tmp_path):
    return write_megatron(tmp_path / "corpus", DOCUMENTS)


@pytest.mark.parametrize("offset, data, says", [
    (0, b"NOTANIDX\x00", "magic"),
    (9, struct.pack("<Q", 2), "version 2"),
    (17, bytes([6]), "dtype code 6 (a float64 dataset"),
    (17, bytes([99]), "dtype code 99"),
    (18, struct.pack("<Q", 4), "says 4 sequences"),
    (26, struct.pack("<Q", 10**15), "document-index entries"),
    (HEADER, struct.pack("<i", -3), "length -3"),  # sequence 0's length
    (HEADER + 12 + 8, struct.pack("<q", 7), "said to start at byte 7"),  # sequence 1's offset
    (HEADER + 36, struct.pack("<q", 1), "runs from 1"),  # the document index's first entry
    (HEADER + 36 + 8, struct.pack("<q", 3), "smaller than the one before it"),
])
def test_an_index_that_lies_is_refused_naming_it(prefix, offset, data, says):
    patched(f"{prefix}.idx", offset, data)
    with pytest.raises(DataError, match="corpus.idx") as caught:
        opened(prefix)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_bin_of_another_size_than_its_index_says_is_refused(prefix):
    with open(f"{prefix}.bin", "ab") as handle:
        handle.write(b"\x00\x00")
    with pytest.raises(DataError, match=r"corpus.bin' is 802 bytes.*take 800"):
        opened(prefix)


def test_a_missing_bin_is_refused(prefix):
    os.unlink(f"{prefix}.bin")
    with pytest.raises(DataError, match=r"corpus.bin' cannot be read: No such file"):
        opened(prefix)


def test_a_short_index_is_refused(prefix):
    with open(f"{prefix}.idx", "wb") as handle:
        handle.write(b"MMIDIDX")
    with pytest.raises(DataError, match="7 bytes, shorter than its 34-byte header"):
        opened(prefix)


def test_links_and_fifos_are_not_followed(tmp_path, prefix):
    os.rename(f"{prefix}.idx", tmp_path / "elsewhere.idx")
    os.symlink(tmp_path / "elsewhere.idx", f"{prefix}.idx")
    with pytest.raises(TriaxError, match="symlink"):
        opened(prefix)
    os.unlink(f"{prefix}.idx")
    os.mkfifo(f"{prefix}.idx")
    with pytest.raises(TriaxError, match="not a regular file"):
        opened(prefix)  # refused at once, not blocked on the FIFO


@pytest.mark.parametrize("header, says", [
    ((20240519, 1, 400), "magic 20240519"),
    ((20240520, 3, 400), "shard version 3"),
    ((20240520, 1, 401), "says it holds 401 uint16 tokens"),
    ((20240520, 1, -1), "says it holds -1"),
    ((20240520, 2, 400), "says it holds 400 uint32 tokens"),
])
def test_a_shard_header_that_lies_is_refused_naming_it(tmp_path, header, says):
    path = write_shard(tmp_path / "train_000001.bin", TOKENS)
    patched(path, 0, np.array(header, dtype="<i4").tobytes())
    with pytest.raises(DataError, match="train_000001.bin") as caught:
        opened(tmp_path / "train_*.bin")
    assert says in str(caught.value)


def test_shards_of_mixed_token_types_and_an_empty_glob_are_refused(tmp_path):
    write_shard(tmp_path / "a_1.bin", TOKENS)
    write_shard(tmp_path / "a_2.bin", TOKENS, version=2)
    with pytest.raises(DataError, match="mix token types"):
        opened(tmp_path / "a_*.bin")
    with pytest.raises(DataError, match="matches no file"):
        opened(tmp_path / "b_*.bin")


def test_a_source_shorter_than_a_window_is_refused(tmp_path):
    write_shard(tmp_path / "short_1.bin", TOKENS[:10])
    write_shard(tmp_path / "long_1.bin", TOKENS)
    with pytest.raises(DataError, match=r"training split of .*short_1\.bin' holds 10 tokens, too few"):
        open_source(str(tmp_path / "short_1.bin"), str(tmp_path / "long_1.bin"), 16, VOCAB, None, 0.9)


def test_settings_that_disagree_with_the_files_are_refused(tmp_path, prefix):
    with pytest.raises(DataError, match="does not record its vocabulary size; set data.vocab_size"):
        open_source(str(prefix), None, 16, None, None, 0.9)
    with pytest.raises(DataError, match="data.token_dtype=uint32 but .* holds uint16"):
        open_source(str(prefix), None, 16, VOCAB, "uint32", 0.9)
    with pytest.raises(DataError, match="token id 60 .* outside the vocabulary"):
        open_source(str(prefix), None, 16, 50, None, 0.9)
    write_shard(tmp_path / "val_1.bin", TOKENS)
    with pytest.raises(DataError, match="val_path .* is shards, but data.path .* is megatron"):
        open_source(str(prefix), str(tmp_path / "val_1.bin"), 16, VOCAB, None, 0.9)
    with pytest.raises(DataError, match="read from local files"):
        opened("s3://bucket/fineweb_train_*.bin")
    with pytest.raises(DataError, match=r"data.eot_token=61 is outside the vocabulary \[0, 61\)"):
        open_source(str(prefix), None, 16, VOCAB, None, 0.9, eot_token=VOCAB)
    with pytest.raises(DataError, match=r"data.val_path '.*nothing' does not exist"):
        open_source(str(prefix), str(tmp_path / "nothing"), 16, VOCAB, None, 0.9)
    (tmp_path / "plain.txt").write_text("not tokens")
    with pytest.raises(DataError, match="is a file of no known token format"):
        opened(tmp_path / "plain.txt")


def test_the_command_line_says_one_line_and_exits_2(tmp_path, prefix, capsys):
    patched(f"{prefix}.idx", 0, b"NOTANIDX\x00")
    code = triax_main(["train", "data.task=tokens", f"data.path={prefix}", f"data.vocab_size={VOCAB}",
                       f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "corpus.idx" in err and "magic" in err
