"""A Hugging Face `tokenizers` tokenizer behind the small interface the trainer and `triax
generate` use for characters (encode, decode, len)."""

from __future__ import annotations

from triax import safe_files
from triax.data.errors import DataError, MissingDependency

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
            self.tokenizer = tokenizers.Tokenizer.from_str(json_text)
        except Exception as error:  # the Rust side raises a bare Exception with its parser's message
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(f"{source!r} is not a valid tokenizer.json ({first})") from None
        self.json_text = json_text

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
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [item.ids for item in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
