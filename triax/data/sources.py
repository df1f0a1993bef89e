"""One token source, in whichever format it was written, as training and validation windows.

`data.path` (and each mixture source's `path`) names one of:
- nanoGPT's layout: a directory (or fsspec URL) with train.bin, val.bin and meta.json
  (triax.data.tokens);
- a Megatron-LM indexed dataset: the prefix of `prefix.bin` + `prefix.idx` (triax.data.megatron);
- llm.c / modded-nanogpt shards: a glob, or one shard (triax.data.shards).
The format is recognised from the path itself, once. A Megatron dataset or a set of shards holds
one split: its validation windows come from `val_path` (the same format), else from its tail, the
last 1 - train_split of its tokens (a Megatron dataset's cut falls on a document's first token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from triax.data.documents import EndOfText, IndexedStarts
from triax.data.errors import DataError
from triax.data.megatron import IndexedDataset
from triax.data.shards import GLOB_CHARACTERS, is_shard, open_shards
from triax.data.token_stream import TokenStream
from triax.data.tokens import TokenDataset, load_token_datasets

FORMATS = ("nanogpt", "megatron", "shards")


@dataclass
class TokenSource:
    """A source's training and validation windows, its vocabulary and its tokenizer (nanoGPT's
    meta.json may name one), and its format."""

    train: TokenDataset
    val: TokenDataset
    vocab_size: int
    tokenizer_path: str | None
    format: str


def megatron_prefix(path: str) -> str | None:
    """The prefix of the Megatron dataset `path` names (the prefix itself, or its .bin or .idx)."""
    stem, suffix = os.path.splitext(path)
    for candidate in ([stem] if suffix in (".bin", ".idx") else []) + [path]:
        if os.path.lexists(candidate + ".idx"):
            return candidate
    return None


def source_format(path: str, key: str = "data.path") -> str:
    """nanogpt, megatron or shards: what `path` names (one line naming `key`, the option the user gave it
    as, when it is none of them)."""
    if "://" in path:
        if any(character in path for character in GLOB_CHARACTERS) or path.endswith((".bin", ".idx")):
            raise DataError(f"{key} {path!r}: Megatron datasets and llm.c shards are read from local files "
                            "(memory-mapped); copy them to a local disk (a token directory may be a URL)")
        return "nanogpt"  # remote token directories are read by range (triax.data.tokens)
    if any(character in path for character in GLOB_CHARACTERS):
        return "shards"
    if megatron_prefix(path) is not None:
        return "megatron"
    if os.path.isdir(path):
        return "nanogpt"
    if is_shard(path):
        return "shards"
    what = "does not exist" if not os.path.lexists(path) else "is a file of no known token format"
    raise DataError(f"{key} {path!r} {what}; give a directory with train.bin and val.bin (nanoGPT), the "
                    "prefix of a Megatron dataset (PREFIX.bin + PREFIX.idx) or a glob of llm.c shards")


def _stream(path: str, kind: str, eot_token: int | None) -> tuple[TokenStream, object | None]:
    """A Megatron dataset's or a set of shards' tokens, and where its documents begin
    (triax.data.documents): Megatron's index, else at each data.eot_token if set."""
    if kind == "megatron":
        dataset = IndexedDataset(megatron_prefix(path))
        return dataset.stream, IndexedStarts(dataset.document_starts())
    return open_shards(path), (EndOfText(eot_token) if eot_token is not None else None)


def _windows(stream: TokenStream, block_size: int, vocab_size: int, what: str,
             documents: object | None = None) -> TokenDataset:
    if stream.num_tokens <= block_size:
        raise DataError(f"{what} {stream.path!r} holds {stream.num_tokens} tokens, too few for one window of "
                        f"data.block_size + 1 = {block_size + 1}; use a smaller block_size or more data")
    dataset = TokenDataset(stream, block_size, vocab_size, documents)
    dataset.check_sample()
    return dataset


def _check_end_of_text(eot_token: int | None, vocab_size: int) -> None:
    """data.eot_token must be a token of the vocabulary, or no document would ever be found to begin."""
    if eot_token is not None and eot_token >= vocab_size:
        raise DataError(f"data.eot_token={eot_token} is outside the vocabulary [0, {vocab_size}); give the "
                        "end-of-text token's id in these files (50256 for GPT-2's <|endoftext|>)")


def _check_dtype(stream: TokenStream, token_dtype: str | None) -> None:
    if token_dtype is not None and np.dtype(token_dtype) != stream.dtype:
        raise DataError(f"data.token_dtype={token_dtype} but {stream.path!r} holds {stream.dtype} tokens (its "
                        "header says so); leave data.token_dtype unset for this format")


def open_source(path: str | None, val_path: str | None, block_size: int, vocab_size: int | None,
                token_dtype: str | None, train_split: float, eot_token: int | None = None,
                key: str = "data") -> TokenSource:
    """The windows of one source in any format (see the module's docstring); `key` is where its
    settings were given (data, or data.sources.N), for the messages."""
    if not path:
        raise DataError("data.task=tokens needs data.path: a token directory (`triax tokenize` writes one), "
                        "a Megatron dataset's prefix or a glob of llm.c shards")
    kind = source_format(path, f"{key}.path")
    if kind == "nanogpt":
        if val_path:
            raise DataError(f"{key}.val_path={val_path!r} is for Megatron datasets and shards; the token directory "
                            f"{path!r} has its own val.bin")
        train, val, vocab_size, tokenizer = load_token_datasets(path, block_size, vocab_size, token_dtype)
        _check_end_of_text(eot_token, vocab_size)
        if eot_token is not None:
            train.documents = val.documents = EndOfText(eot_token)
        return TokenSource(train, val, vocab_size, tokenizer, kind)
    if vocab_size is None:
        raise DataError(f"{path!r} ({kind}) does not record its vocabulary size; set data.vocab_size "
                        "(e.g. 50304 for GPT-2's tokens)")
    _check_end_of_text(eot_token, vocab_size)
    stream, documents = _stream(path, kind, eot_token)
    _check_dtype(stream, token_dtype)
    if val_path:
        val_kind = source_format(val_path, f"{key}.val_path")
        if val_kind != kind:
            raise DataError(f"{key}.val_path {val_path!r} is {val_kind}, but {key}.path {path!r} is {kind}; "
                            "give validation data in the same format")
        val_stream, val_documents = _stream(val_path, kind, eot_token)
        _check_dtype(val_stream, token_dtype)
    else:
        cut = int(stream.num_tokens * train_split)
        if isinstance(documents, IndexedStarts) and len(documents.starts):  # cut where a document starts
            later = documents.starts[documents.starts >= cut]
            cut = int(later[0]) if len(later) else stream.num_tokens
        end = stream.num_tokens
        stream, val_stream = stream.part(0, cut), stream.part(cut, end)
        if documents is not None:
            documents, val_documents = documents.part(0, cut), documents.part(cut, end)
        else:
            val_documents = None
    train = _windows(stream, block_size, vocab_size, "the training split of", documents)
    val = _windows(val_stream, block_size, vocab_size, "the validation split of", val_documents)
    return TokenSource(train, val, vocab_size, None, kind)
