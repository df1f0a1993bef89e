"""`triax tokenize --workers N`: the text cut into pieces in order, encoded by N processes, written
in order; `--format megatron`: with each split's document index beside its tokens.

The main process reads the inputs in chunks that end at line ends (triax.data.tokenize_files) and
decides, for each chunk, which split it goes to and whether it ends a document (an input file is
one document). Only encoding, the expensive part, goes to the workers, and their results come back
in the order the chunks were read, so N workers write exactly the tokens one does: the
chunks, and so the ids, do not depend on N. Workers are spawned (not forked: the parent's
tokenizer thread pool does not survive a fork) and each encodes with one thread, so N workers use
N cores.

With `--format megatron` the output directory also holds train.idx and val.idx, Megatron-LM's
index of train.bin and val.bin (triax.data.megatron: one sequence per document, documents ending
where input files end and where the validation split begins). The .bin files are the same flat
token arrays as nanoGPT's layout, so the directory trains as either: `data.path=OUT` or
`data.path=OUT/train data.val_path=OUT/val`.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from typing import Iterator

import numpy as np

from triax.data.megatron import HEADER, MAGIC, VERSION

# megatron-core's dtype codes of the two token types `triax tokenize` writes for this format
# (Megatron has no uint32: a vocabulary above 65,536 tokens is stored as int32).
MEGATRON_DTYPES = {"uint16": 8, "int32": 4}
# Byte-level BPE works word by word, and its cost grows faster than a word's length: a file with
# no line break or space (minified JSON, a base64 blob) is one word of megabytes and took minutes.
# Longer lines are cut into pieces of at most this many characters, at the last space when there
# is one. Ordinary text never has a line this long, so its ids are those of the whole text.
LONGEST_PIECE = 4096
# Chunks sent to each worker ahead of the one being written: enough that a worker never waits for
# the next while the writer catches up, few enough that memory stays a few chunks a worker.
IN_FLIGHT = 3


def pieces(text: str) -> list[str]:
    """The lines of `text` (ends kept), each line longer than LONGEST_PIECE cut into pieces."""
    result = []
    for line in text.splitlines(keepends=True):
        while len(line) > LONGEST_PIECE:
            cut = line.rfind(" ", LONGEST_PIECE // 2, LONGEST_PIECE) + 1 or LONGEST_PIECE
            result.append(line[:cut])
            line = line[cut:]
        result.append(line)
    return result


_worker_tokenizer = None  # a worker process's tokenizer, built once by _start_worker


def _start_worker(tokenizer_json: str, source: str = "tokenizer.json") -> None:
    global _worker_tokenizer
    os.environ["RAYON_NUM_THREADS"] = "1"  # one core per worker: N workers, N cores
    from triax.data.tokenizer import BPETokenizer  # deferred: after the thread setting its library reads

    _worker_tokenizer = BPETokenizer(tokenizer_json, source)  # its errors name the file, as one worker's do


def encode_text(tokenizer: object, text: str, dtype: str) -> np.ndarray:
    """The ids of `text`, line by line in one call (lines end where GPT-2's pre-tokenizer splits
    anyway, so the ids are those of the whole text)."""
    lines = tokenizer.encode_batch(pieces(text))
    return np.fromiter((i for line in lines for i in line), dtype=dtype)


def _encode_in_worker(job: tuple[str, str]) -> np.ndarray:
    text, dtype = job
    return encode_text(_worker_tokenizer, text, dtype)


def encoded(tokenizer: object, texts: Iterator[str], dtype: str, workers: int) -> Iterator[np.ndarray]:
    """The ids of each text, in order, encoded here by `tokenizer` (a BPETokenizer; workers=1) or
    by `workers` processes."""
    if workers <= 1:
        for text in texts:
            yield encode_text(tokenizer, text, dtype)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer.json_text, tokenizer.source)) as pool:
        # Not Pool.imap: its feeder thread takes every task at once, so it would read the whole
        # input into memory ahead of the writer. Here at most IN_FLIGHT chunks a worker are sent
        # ahead, one chunk a task, and taken back in the order they were read.
        window: collections.deque = collections.deque()
        for text in texts:
            window.append(pool.apply_async(_encode_in_worker, ((text, dtype),)))
            if len(window) >= IN_FLIGHT * workers:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()


def index_bytes(dtype: str, document_lengths: list[int]) -> bytes:
    """Megatron's .idx for a .bin of these documents, one sequence each (triax.data.megatron)."""
    lengths = np.asarray(document_lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    offsets = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * itemsize)]).astype(np.int64)
    document_index = np.arange(len(lengths) + 1, dtype=np.int64)
    header = HEADER.pack(MAGIC, VERSION, MEGATRON_DTYPES[dtype], len(lengths), len(document_index))
    return header + lengths.tobytes() + offsets[:len(lengths)].tobytes() + document_index.tobytes()

