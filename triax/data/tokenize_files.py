"""`triax tokenize` (triax.commands.tokenize): text files -> a token directory (train.bin, val.bin,
tokenizer.json, meta.json).

Trains a byte-level BPE with Hugging Face `tokenizers` on the inputs (or uses a given
tokenizer.json), then encodes them. Both passes stream: text is read in chunks cut at line ends and
token ids are appended to the output files chunk by chunk, so inputs may be larger than memory.
The last `--val-fraction` of the text (by bytes, cut at a chunk boundary) becomes val.bin, as the
char task validates on the tail of its text.
"""

from __future__ import annotations

import collections
import json
import os
import posixpath
from typing import Any, Iterator, TYPE_CHECKING

import numpy as np

from triax import safe_files
from triax.data.errors import DataError
from triax.data.text_records import is_records, record_texts
from triax.data.tokenize_parallel import encoded, index_bytes, pieces
from triax.errors import printable

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from tokenizers import Tokenizer
    from tqdm import tqdm

# Progress bars (tqdm, disable=None) show only when stderr is a terminal: logs and pipes get one line.
CHUNK_CHARACTERS = 1 << 20  # text handed to the tokenizer at once; bounds memory whatever the input size
MIN_VOCAB_SIZE = 256  # byte-level BPE starts from the 256 byte symbols
OUTPUT_FILES = ("train.bin", "val.bin", "train.idx", "val.idx", "tokenizer.json", "meta.json")


def expand_inputs(inputs: list[str]) -> list[tuple[object, str, int]]:
    """(filesystem, path, size in bytes) of every file the inputs name: paths, globs or fsspec URLs."""
    import fsspec

    files = []
    for item in inputs:
        fs, path = fsspec.core.url_to_fs(item)
        if any(character in path for character in "*?["):
            matches = sorted(match for match in fs.glob(path) if fs.isfile(match))
            if not matches:
                raise DataError(f"input {item!r} matches no file")
        elif fs.isfile(path):
            matches = [path]
        elif fs.isdir(path):
            raise DataError(f"input {item!r} is a directory; give its text files (a glob like {item.rstrip('/')}/*.txt works)")
        elif fs.exists(path):  # a FIFO, a device, a socket: no size to read to its end
            raise DataError(f"input {item!r} is not a regular file (a FIFO, device or socket); give a text file")
        else:
            raise DataError(f"input {item!r} does not exist")
        files += [(fs, match, fs.size(match)) for match in matches]
    if sum(size for _, _, size in files) == 0:
        raise DataError(f"the inputs hold no text ({len(files)} empty file(s)); nothing to tokenize")
    return files


def read_chunks(files: list[tuple[AbstractFileSystem, str, int]], progress: tqdm | None = None):
    """The text of all files, as chunks of about CHUNK_CHARACTERS that end at a line end (a line
    longer than a chunk is cut where the chunk is full). Yields (chunk, bytes read so far)."""
    for fs, path, _ in files:
        carry = ""
        with fs.open(path, "rb") as raw:
            import io

            handle = io.TextIOWrapper(raw, encoding="utf-8", newline="")
            position = 0
            while True:
                try:
                    text = handle.read(CHUNK_CHARACTERS)
                except UnicodeDecodeError as error:
                    raise DataError(f"input {path!r} is not UTF-8 text ({error.reason} near byte "
                                      f"{position + error.start})") from None
                if not text:
                    break
                before = position
                position = raw.tell() if hasattr(raw, "tell") else position + len(text.encode())
                text = carry + text
                cut = text.rfind("\n") + 1
                if cut == 0:
                    cut = len(text) if len(text) >= CHUNK_CHARACTERS else 0
                chunk, carry = text[:cut], text[cut:]
                if progress is not None:
                    progress.update(position - before)
                if chunk:
                    yield chunk
            if carry:
                yield carry


def file_texts(file: tuple[AbstractFileSystem, str, int], progress: tqdm | None,
               text_field: str) -> Iterator[tuple[str, bool, int]]:
    """(text, whether it ends a document, the bytes it takes in the file) of one input: a text file
    is one document, read in chunks ("" ends it); a JSON Lines file's records are a document each
    (triax.data.text_records)."""
    fs, path, _ = file
    if is_records(path):
        for text, size in record_texts(fs, path, text_field, progress):
            yield text, True, size
        return
    for chunk in read_chunks([file], progress):
        yield chunk, False, len(chunk.encode("utf-8"))
    yield "", True, 0


def train_bpe(files: list[tuple[AbstractFileSystem, str, int]], vocab_size: int, text_field: str = "text"):
    from triax.data.tokenizer import require_tokenizers

    tokenizers = require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from tqdm import tqdm

    # Byte-level: every string is some sequence of the 256 byte symbols, so any text encodes (no
    # unknown token) and decode(encode(text)) == text.
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    total = sum(size for _, _, size in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="train BPE", leave=False, disable=None) as progress:
        texts = (text for file in files for text, _, _ in file_texts(file, progress, text_field))
        tokenizer.train_from_iterator((piece for text in texts for piece in pieces(text)), trainer=trainer)
    return tokenizer.to_str()


def split_point(data: bytes, at: int) -> int:
    """Where to cut UTF-8 `data` near byte `at`: after the next newline, else at a character start."""
    newline = data.find(b"\n", at)
    if newline >= 0:
        return newline + 1
    while at < len(data) and (data[at] & 0xC0) == 0x80:  # a continuation byte: not a character start
        at += 1
    return at


def _is_local(fs: AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def _create(fs: AbstractFileSystem, path: str):
    """A new output file; locally never through a planted link (a stale one is removed, not followed)."""
    if not _is_local(fs):
        return fs.open(path, "wb")
    safe_files.remove_file(path)
    return safe_files.create_new(path)


def _write(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    if _is_local(fs):
        safe_files.write_atomic(path, data)
    else:
        with fs.open(path, "wb") as handle:
            handle.write(data)


def _pieces_in_order(files: list[tuple[AbstractFileSystem, str, int]], progress: tqdm, train_bytes: float,
                     text_field: str) -> Iterator[tuple[str, str, bool]]:
    """(split, text, whether it ends a document) of all inputs in reading order. The last train text
    ends a document too, where the validation tail begins (a JSON Lines record is never cut)."""
    seen = 0
    for file in files:
        for text, ends, size in file_texts(file, progress, text_field):
            if seen + size <= train_bytes or (ends and seen < train_bytes):
                yield "train", text, ends
            elif seen >= train_bytes:
                yield "val", text, ends
            else:  # the chunk crosses the boundary: cut it at the next line end (else a character boundary)
                data = text.encode("utf-8")
                cut = split_point(data, int(train_bytes - seen))
                yield "train", data[:cut].decode("utf-8"), True
                yield "val", data[cut:].decode("utf-8"), False
            seen += size


def encode_files(files: list[tuple[AbstractFileSystem, str, int]], tokenizer: Tokenizer, out_fs: AbstractFileSystem,
                 out_dir: str, dtype: str, val_fraction: float, workers: int = 1,
                 text_field: str = "text") -> dict[str, list[int]]:
    """Encode all text into train.bin then val.bin (the tail), by `workers` processes
    (triax.data.tokenize_parallel); returns each split's document lengths in tokens."""
    from tqdm import tqdm

    total = sum(size for _, _, size in files)
    documents: dict[str, list[int]] = {"train": [], "val": []}
    open_document = {"train": 0, "val": 0}
    handles = {split: _create(out_fs, posixpath.join(out_dir, f"{split}.bin.tmp")) for split in documents}
    pending: collections.deque = collections.deque()  # (split, ends a document) of each text sent, in order

    def texts(progress: tqdm) -> Iterator[str]:
        for split, text, ends in _pieces_in_order(files, progress, total * (1.0 - val_fraction), text_field):
            pending.append((split, ends))
            yield text

    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="encode", leave=False, disable=None) as progress:
            for ids in encoded(tokenizer, texts(progress), dtype, workers):
                split, ends = pending.popleft()
                handles[split].write(ids.tobytes())
                open_document[split] += len(ids)
                if ends and open_document[split]:
                    documents[split].append(open_document[split])
                    open_document[split] = 0
    finally:
        for handle in handles.values():
            handle.close()
    return documents


def tokenize_text(inputs: list[str], out: str, *, vocab_size: int | None, tokenizer_file: str | None,
                  val_fraction: float, overwrite: bool, workers: int = 1, megatron: bool = False,
                  text_field: str = "text") -> int:
    """Train a BPE (or use `tokenizer_file`) on the inputs and write `out`'s token directory
    (the arguments checked by triax.commands.tokenize)."""
    from triax.data.tokenizer import BPETokenizer, require_tokenizers

    require_tokenizers()
    import fsspec

    out_fs, out_dir = fsspec.core.url_to_fs(out)
    if out_fs.isfile(out_dir):
        raise DataError(f"--out {out!r} is a file; give a directory")
    # lexists locally: a dangling link named meta.json is there too (and would be written through).
    exists = os.path.lexists if _is_local(out_fs) else out_fs.exists
    existing = [name for name in OUTPUT_FILES if exists(posixpath.join(out_dir, name))]
    if existing and not overwrite:
        raise DataError(f"--out {out!r} already holds {', '.join(existing)}; pass --overwrite or choose another directory")
    files = expand_inputs(inputs)
    if tokenizer_file:
        tokenizer = BPETokenizer.from_file(tokenizer_file)
    else:
        tokenizer = BPETokenizer(train_bpe(files, vocab_size or 4096, text_field))
    vocab_size = len(tokenizer)
    # Megatron's index has no uint32 code: its large vocabularies are int32.
    dtype = "uint16" if vocab_size <= 1 << 16 else ("int32" if megatron else "uint32")
    if _is_local(out_fs):
        safe_files.make_directory(out_dir)  # not a symlink to somewhere else
    else:
        out_fs.makedirs(out_dir, exist_ok=True)
    documents = encode_files(files, tokenizer, out_fs, out_dir, dtype, val_fraction, workers, text_field)
    train_tokens, val_tokens = (sum(documents[split]) for split in ("train", "val"))
    if val_tokens == 0 or train_tokens == 0:
        for split in ("train", "val"):
            out_fs.rm(posixpath.join(out_dir, f"{split}.bin.tmp"))
        raise DataError(f"the inputs are too small to split: {train_tokens} train / {val_tokens} val tokens "
                          f"with --val-fraction {val_fraction}; give more text or change --val-fraction")
    for split in ("train", "val"):
        out_fs.mv(posixpath.join(out_dir, f"{split}.bin.tmp"), posixpath.join(out_dir, f"{split}.bin"))
        index = posixpath.join(out_dir, f"{split}.idx")
        if megatron:  # the document index beside the tokens: the directory is a Megatron dataset too
            _write(out_fs, index, index_bytes(dtype, documents[split]))
        elif exists(index):  # an --overwrite'n directory's old index would describe other tokens
            out_fs.rm(index)
    _write(out_fs, posixpath.join(out_dir, "tokenizer.json"), tokenizer.json_text.encode("utf-8"))
    meta = {"vocab_size": vocab_size, "dtype": dtype, "tokenizer": "tokenizer.json",
            "train_tokens": train_tokens, "val_tokens": val_tokens}
    # last: marks the directory complete
    _write(out_fs, posixpath.join(out_dir, "meta.json"), json.dumps(meta, indent=1).encode("utf-8"))
    total_bytes = sum(size for _, _, size in files)
    print(printable(f"wrote {train_tokens} train + {val_tokens} val tokens ({dtype}, vocabulary {vocab_size}) from "
                    f"{len(files)} file(s), {total_bytes / 1e6:.2f} MB, to {out} "
                    f"({total_bytes / max(train_tokens + val_tokens, 1):.2f} bytes/token)"))
    return 0
