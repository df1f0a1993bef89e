"""JSON Lines corpora for `triax tokenize`: one JSON object a line (FineWeb's, The Pile's, most
web dumps), whose text field is one document. A line that is not a JSON object, a record without
the field or with a field that is not text, or a line longer than MAX_LINE_CHARACTERS (read in
bounded pieces, never whole) is refused with one line naming the file and the line."""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING, Iterator

from triax.data.errors import DataError
from triax.errors import printable

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from tqdm import tqdm

RECORD_SUFFIXES = (".jsonl",)
# A record is a web page or a book; a line longer than this is a damaged file, not read whole.
MAX_LINE_CHARACTERS = 1 << 26


def is_records(path: str) -> bool:
    return path.endswith(RECORD_SUFFIXES)


def record_texts(fs: AbstractFileSystem, path: str, field: str,
                 progress: tqdm | None = None) -> Iterator[tuple[str, int]]:
    """The `field` text of every record of the JSON Lines file `path`, in order, and the bytes its
    line takes in the file (a blank line's count with the next record's)."""
    with fs.open(path, "rb") as raw:
        handle = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
        number, skipped = 0, 0
        while True:
            number += 1
            try:
                line = handle.readline(MAX_LINE_CHARACTERS + 1)
            except UnicodeDecodeError as error:
                raise DataError(f"{path!r} line {number} is not UTF-8 ({error.reason})") from None
            if not line:
                return
            if len(line) > MAX_LINE_CHARACTERS:
                raise DataError(f"{path!r} line {number} is longer than {MAX_LINE_CHARACTERS} characters; "
                                "it is damaged or not JSON Lines")
            size = len(line.encode("utf-8"))
            if progress is not None:
                progress.update(size)
            if not line.strip():
                skipped += size
                continue
            yield _text_of(line, field, path, number), size + skipped
            skipped = 0


def _text_of(line: str, field: str, path: str, number: int) -> str:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise DataError(f"{path!r} line {number} is not JSON ({error.msg}); a .jsonl file holds one "
                        "JSON object a line") from None
    if not isinstance(record, dict):
        raise DataError(f"{path!r} line {number} is a JSON {type(record).__name__}, not an object")
    if field not in record:
        raise DataError(printable(f"{path!r} line {number} has no {field!r} field (it has "
                                  f"{', '.join(map(repr, list(record)[:8]))}); name the text with --text-field"))
    if not isinstance(record[field], str):
        raise DataError(f"{path!r} line {number}: {field!r} is a {type(record[field]).__name__}, not text")
    return record[field]
