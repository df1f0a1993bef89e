"""A Hugging Face `tokenizers` tokenizer behind the small interface the trainer and `triax
generate` use for characters (encode, decode, len)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Sequence

from triax import safe_files
from triax.data.errors import DataError, MissingDependency
from triax.errors import ConfigError

INSTALL_HINT = "pip install 'triax[tokenize]' (or: pip install tokenizers)"


def require_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise MissingDependency(f"this needs the Hugging Face tokenizers package; install it with: {INSTALL_HINT}") from None
    return tokenizers


class BPETokenizer:
    """Text <-> token ids with a tokenizer.json (byte-level BPE from `triax tokenize`, GPT-2's, ...)."""

    def __init__(self, json_text: str, source: str = "tokenizer.json"):
        tokenizers = require_tokenizers()
        try:
            with _panics_as_errors(source):
                self.tokenizer = tokenizers.Tokenizer.from_str(json_text)
        except DataError:
            raise
        except Exception as error:  # the Rust side raises a bare Exception with its parser's message
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(f"{source!r} is not a valid tokenizer.json ({first})") from None
        self.json_text = json_text
        self.source = source

    @classmethod
    def from_file(cls, path: str) -> "BPETokenizer":
        try:
            raw = safe_files.read_location(path)  # no link, FIFO or huge file
        except (FileNotFoundError, IsADirectoryError):
            raise DataError(f"tokenizer file {path!r} does not exist or is not a file") from None
        except OSError as error:
            raise DataError(f"tokenizer file {path!r} cannot be read: {error}") from None
        try:
            return cls(raw.decode("utf-8"), path)
        except UnicodeDecodeError:
            raise DataError(f"tokenizer file {path!r} is not UTF-8 JSON") from None

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        with _panics_as_errors(self.source):
            return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        with _panics_as_errors(self.source):
            return [item.ids for item in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        with _panics_as_errors(self.source):
            return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


@contextlib.contextmanager
def _panics_as_errors(source: str):
    """A panic of the Rust library (a tokenizer.json whose pre-tokenizer regex backtracks without
    end makes its regex engine give up by panicking) as one line. pyo3 raises a panic as
    PanicException, a BaseException that `except Exception` misses; Rust's panic hook has already
    written its message and a backtrace note to file descriptor 2, so that is captured during the
    call and written through afterwards only if nothing panicked."""
    try:
        saved = os.dup(2)
    except OSError:  # no standard error to hold back (closed): nothing to capture
        saved = None
    captured = tempfile.TemporaryFile() if saved is not None else None
    if captured is not None:
        os.dup2(captured.fileno(), 2)
    panicked = False
    try:
        yield
    except BaseException as error:
        if type(error).__name__ != "PanicException":
            raise
        panicked = True
        first = str(error).splitlines()[0] if str(error) else "a panic"
        raise DataError(f"tokenizer {source!r} failed inside the tokenizers library ({first[:200]}); its "
                        "pre-tokenizer or normalizer cannot handle this text: use another tokenizer.json") from None
    finally:
        if captured is not None:
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:  # anything else written meanwhile (a warning) is passed on
                captured.seek(0)
                data = captured.read()
                if data:
                    os.write(2, data)
            captured.close()


def require_checkpoint_tokenizer(task: str, codec: object, source: object | None, why: str) -> None:
    """Chat and preference data are encoded by model.init_from's tokenizer: one line naming what is
    missing, the checkpoint or (when one was given) its tokenizer.json."""
    if source is None:
        raise ConfigError(f"data.task={task} needs model.init_from: a transformers checkpoint directory with "
                          f"tokenizer.json ({why})")
    if not isinstance(codec, BPETokenizer):
        raise ConfigError(f"data.task={task}: model.init_from={source.path!r} has no tokenizer.json "
                          f"({why}); give a checkpoint directory that holds one")
