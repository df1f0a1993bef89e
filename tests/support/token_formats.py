"""Writers of other tools' token formats, from their documented layouts, for tests: Megatron's
indexed dataset (prefix.bin + prefix.idx) and llm.c's shards (a 256-int32 header, then tokens)."""

import struct

import numpy as np

MEGATRON_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def write_megatron(prefix, documents, dtype="uint16"):
    """One sequence per document, as IndexedDatasetBuilder.add_item + end_document write them."""
    dtype = np.dtype(dtype)
    lengths = np.array([len(document) for document in documents], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize)]).astype(np.int64)
    with open(f"{prefix}.bin", "wb") as handle:
        for document in documents:
            handle.write(np.asarray(document, dtype=dtype).tobytes())
    document_index = np.arange(len(documents) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as handle:
        handle.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, MEGATRON_CODES[dtype.name], len(lengths),
                                                         len(document_index)))
        handle.write(lengths.tobytes() + offsets.tobytes() + document_index.tobytes())
    return prefix


def write_shard(path, tokens, version=1):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, version, len(tokens))
    with open(path, "wb") as handle:
        handle.write(header.tobytes() + np.asarray(tokens, dtype=np.uint16 if version == 1 else np.uint32).tobytes())
    return path


def split_documents(tokens, seed, shortest=5, longest=60):
    """`tokens` cut into documents of random lengths (the cuts fixed by `seed`)."""
    rng = np.random.default_rng(seed)
    documents, begin = [], 0
    while begin < len(tokens):
        end = min(len(tokens), begin + int(rng.integers(shortest, longest)))
        documents.append(tokens[begin:end])
        begin = end
    return documents
