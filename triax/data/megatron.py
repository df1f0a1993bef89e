"""Megatron-LM's indexed datasets, read as megatron-core's IndexedDatasetBuilder writes them.

A dataset is two files with one prefix. `prefix.bin` holds the token ids of every sequence end to
end, nothing else. `prefix.idx` says where they are, all little-endian:

    9 bytes   b"MMIDIDX\\x00\\x00"                   the magic
    uint64    1                                      the version
    uint8     dtype code                             1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                                     6 float64, 7 float32, 8 uint16
    uint64    S                                      sequences
    uint64    D                                      entries of the document index
    int32[S]  each sequence's length in tokens
    int64[S]  each sequence's byte offset in prefix.bin
    int64[D]  the document index: 0, then the sequence count at the end of each document
    int8[S]   (multimodal datasets only) each sequence's mode

So a dataset holds D - 1 documents, document k being sequences [index[k], index[k + 1]). The
writer lays the sequences out back to back, so the offsets are the running sum of the lengths
and prefix.bin is exactly that long: every one of these facts is checked when the files are
opened, and a file that lies about any of them is refused with one line that names it. The
index is read in bounded chunks and kept memory-mapped, like the tokens.
"""

from __future__ import annotations

import struct

import numpy as np

from triax.data.errors import DataError
from triax.data.token_stream import TokenStream, file_size, map_tokens, open_data_file

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# megatron-core's DType codes; the two floating-point codes cannot hold token ids.
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
FLOAT_CODES = {6: "float64", 7: "float32"}
HEADER = struct.Struct("<9sQBQQ")
# The index is checked this many sequences at a time: bounded memory whatever its size.
CHECK_CHUNK = 1 << 20


class IndexedDataset:
    """A checked Megatron dataset: its tokens as one stream and its documents' first tokens."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.index_path, self.data_path = prefix + ".idx", prefix + ".bin"
        self._read_index()
        self._check_offsets()
        self.stream = TokenStream([map_tokens(self.data_path, self.dtype, 0, self.num_tokens)], prefix)

    @property
    def document_count(self) -> int:
        return len(self.document_index) - 1

    def _refuse(self, what: str) -> DataError:
        return DataError(f"{self.index_path!r} is not a Megatron index megatron-core could have written: {what}")

    def _read_index(self) -> None:
        with open_data_file(self.index_path) as handle:  # no link, FIFO or directory
            size = handle.seek(0, 2)
            if size < HEADER.size:
                raise self._refuse(f"{size} bytes, shorter than its {HEADER.size}-byte header")
            handle.seek(0)
            magic, version, code, sequences, entries = HEADER.unpack(handle.read(HEADER.size))
            self._check_header(magic, version, code, sequences, entries, size)
            mapped = np.memmap(handle, dtype=np.uint8, mode="r")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.lengths = np.frombuffer(mapped, np.int32, sequences, HEADER.size)
        self.offsets = np.frombuffer(mapped, np.int64, sequences, HEADER.size + 4 * sequences)
        self.document_index = np.frombuffer(mapped, np.int64, entries, HEADER.size + 12 * sequences)

    def _check_header(self, magic: bytes, version: int, code: int, sequences: int, entries: int, size: int) -> None:
        if magic != MAGIC:
            raise self._refuse(f"magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise self._refuse(f"version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            kind = f"a {FLOAT_CODES[code]} dataset, not token ids" if code in FLOAT_CODES else "unknown"
            raise self._refuse(f"dtype code {code} ({kind}); token datasets use codes {sorted(DTYPE_CODES)}")
        # Sizes before any allocation: the counts must describe exactly this file.
        arrays = HEADER.size + sequences * (4 + 8) + entries * 8
        if size not in (arrays, arrays + sequences):  # + one mode byte per sequence when multimodal
            raise self._refuse(f"it says {sequences} sequences and {entries} document-index entries, which "
                               f"take {arrays} bytes (or {arrays + sequences} with modes), but it has {size}")
        if entries < 1:
            raise self._refuse("its document index is empty (it must begin with 0)")

    def _check_offsets(self) -> None:
        """Each sequence's offset is the sum of the lengths before it; prefix.bin ends with the last;
        the document index rises from 0 to the sequence count."""
        itemsize, expected = self.dtype.itemsize, 0
        for begin in range(0, len(self.lengths), CHECK_CHUNK):
            lengths = self.lengths[begin:begin + CHECK_CHUNK].astype(np.int64)
            if lengths.min() < 0:
                sequence = begin + int(np.argmax(lengths < 0))
                raise self._refuse(f"sequence {sequence} has length {int(self.lengths[sequence])}")
            starts = expected + np.concatenate([[0], np.cumsum(lengths[:-1] * itemsize)])
            wrong = np.flatnonzero(self.offsets[begin:begin + CHECK_CHUNK] != starts)
            if len(wrong):
                sequence = begin + int(wrong[0])
                raise self._refuse(f"sequence {sequence} is said to start at byte {int(self.offsets[sequence])}, "
                                   f"but the lengths before it put it at byte {int(starts[wrong[0]])}")
            expected = int(starts[-1] + lengths[-1] * itemsize)
        self.num_tokens = expected // itemsize
        data_size = file_size(self.data_path)
        if data_size != expected:
            raise DataError(f"{self.data_path!r} is {data_size} bytes, but {self.index_path!r} says its "
                            f"{len(self.lengths)} sequences of {self.dtype} take {expected}; the two files do not "
                            "belong together (or one is truncated)")
        self._check_document_index()

    def _check_document_index(self) -> None:
        index, sequences = self.document_index, len(self.lengths)
        if index[0] != 0 or index[-1] != sequences:
            raise self._refuse(f"its document index runs from {int(index[0])} to {int(index[-1])}, not from 0 to "
                               f"the sequence count {sequences}")
        for begin in range(0, len(index) - 1, CHECK_CHUNK):
            steps = np.diff(index[begin:begin + CHECK_CHUNK + 1])
            if len(steps) and steps.min() < 0:
                entry = begin + int(np.argmax(steps < 0)) + 1
                raise self._refuse(f"document-index entry {entry} ({int(index[entry])}) is smaller than the one "
                                   "before it")

    def document_starts(self) -> np.ndarray:
        """The first token of every document (an empty document starts where the next one does)."""
        first_sequences = self.document_index[:-1]
        starts = np.empty(len(first_sequences), dtype=np.int64)
        ends_at_last = first_sequences >= len(self.offsets)
        starts[ends_at_last] = self.num_tokens
        starts[~ends_at_last] = self.offsets[first_sequences[~ends_at_last]] // self.dtype.itemsize
        return starts
