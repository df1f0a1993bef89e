"""Chat and instruction data (data.task=chat): local JSONL, JSON or Parquet files of records, each
one conversation, rendered with the checkpoint's chat template and trained with the loss on the
assistant's tokens only.

A record is one of
- {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]} (several turns),
- {"prompt": ..., "completion": ...}: text (a user turn and the assistant's answer) or lists of
  messages (TRL's conversational prompt-completion form),
- Alpaca's {"instruction": ..., "input": ..., "output": ...} (input may be empty or absent).

The tokens are the tokenizer's ids of the rendered text, and the loss mask marks the tokens that
overlap the template's `{% generation %}` spans: transformers' apply_chat_template(...,
return_assistant_tokens_mask=True), token for token. A template without generation tags has its
answers found by rendering the conversation up to each assistant turn (with the generation prompt)
and up to its end: the text between is the answer, end-of-turn marker included (TRL's
completion-only rule). Targets are the next token, scored only where the mask is set
(IGNORE_INDEX elsewhere).

Each example is one row of `block_size` tokens, padded (padding: no target), or several examples
are packed into one row (packing), each followed by the next; `document_ids` then tells the model
which example each position belongs to, so attention and positions stay within it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, IO, Iterable, Sequence, TYPE_CHECKING

import numpy as np
import torch

from triax import safe_files
from triax.data.targets import IGNORE_INDEX
from triax.data.chat_template import (BUILTIN_TEMPLATES, ChatTemplate, TemplateBoundError, TemplateError, special_tokens_of,
                                      template_of_config)
from triax.data.errors import DataError, MissingDependency
from triax.data.length_rules import OVERLONG_RULES
from triax.errors import printable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")
# A JSONL line or a message's text longer than this is not a conversation to train on: refused
# before it is decoded or parsed.
MAX_LINE_BYTES = 16 * 2**20
# A .json file is parsed whole: past this, use JSONL (read line by line).
MAX_JSON_BYTES = 1024 * 2**20
# A Parquet file is read into memory (its bytes, then its rows batch by batch): past this, split it.
MAX_PARQUET_BYTES = 1024 * 2**20
# Records of one Parquet file: its footer's row count is checked before any row is read. Four
# million conversations is more than a fine-tuning file holds (each record's ids are kept in memory
# once tokenized); encoded rows can be far smaller than their records, so the bytes bound no count.
MAX_PARQUET_ROWS = 4 * 2**20
# Rows expanded into Python records at a time, and the most bytes those rows may decode to (each
# conversation at most a JSONL line's worth).
PARQUET_BATCH_ROWS = 64
MAX_PARQUET_BATCH_BYTES = PARQUET_BATCH_ROWS * MAX_LINE_BYTES // 4
# Nesting of a record: a conversation needs 4 levels (record, list, message, text).
MAX_DEPTH = 8


class RecordError(DataError):
    """A chat record that is not one: names the file, the line and the field."""


@dataclass
class Example:
    ids: list[int]
    mask: list[int]  # 1 where the token is part of an answer


def _depth(value: object, limit: int) -> int:
    stack, deepest = [(value, 1)], 0
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack += [(child, level + 1) for child in item.values()]
        elif isinstance(item, list):
            stack += [(child, level + 1) for child in item]
    return deepest


def _text(where: str, field: str, value: object) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{where}: field {field!r} must be text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate ("\ud800"): JSON can hold one, text cannot
        raise RecordError(f"{where}: field {field!r} is not valid text (a lone surrogate "
                          f"{value[error.start]!r} at character {error.start}); fix the record") from None
    return value


FORMS = (("messages",), ("prompt", "completion"), ("instruction", "output"))


def _messages(where: str, field: str, value: object) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: field {field!r} must be a non-empty list of {{role, content}} messages, "
                          f"got {type(value).__name__ if not isinstance(value, list) else 'an empty list'}")
    messages = []
    for number, message in enumerate(value):
        name = f"{field}[{number}]"
        if not isinstance(message, dict):
            raise RecordError(f"{where}: field {name!r} must be an object with role and content, "
                              f"got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            shown = printable(repr(role)[:40])
            raise RecordError(f"{where}: field {name + '.role'!r} is {shown}; use one of {', '.join(ROLES)}")
        messages.append({"role": role, "content": _text(where, name + ".content", message.get("content"))})
    return messages


def record_messages(record: object, where: str) -> list[dict]:
    """The conversation of one record (any of the three forms); RecordError naming the field."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if _depth(record, MAX_DEPTH) > MAX_DEPTH:
        raise RecordError(f"{where}: the record nests more than {MAX_DEPTH} levels deep; not a conversation")
    # A null field is an absent one: a Parquet file's rows all have every column, null where unused.
    record = {key: value for key, value in record.items() if value is not None}
    forms = ["/".join(form) for form in FORMS if any(key in record for key in form)]
    if len(forms) > 1:  # which one was meant is a guess; the other would be dropped without a word
        raise RecordError(f"{where}: the record has both {' and '.join(repr(form) for form in forms)}; keep one form "
                          "of conversation per record")
    if "messages" in record:
        messages = _messages(where, "messages", record["messages"])
    elif "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list):
            messages = _messages(where, "prompt", prompt) + _messages(where, "completion", completion)
        else:
            messages = [{"role": "user", "content": _text(where, "prompt", prompt)},
                        {"role": "assistant", "content": _text(where, "completion", completion)}]
    elif "instruction" in record or "output" in record:
        instruction = _text(where, "instruction", record.get("instruction"))
        extra = record.get("input") or ""
        extra = _text(where, "input", extra)
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": _text(where, "output", record.get("output"))}]
    else:
        keys = ", ".join(sorted(printable(str(key))[:40] for key in record)[:8]) or "none"
        raise RecordError(f"{where}: a record needs field 'messages', 'prompt'/'completion' or "
                          f"'instruction'/'output'; it has {keys}")
    if not any(message["role"] == "assistant" for message in messages):
        raise RecordError(f"{where}: field 'messages' has no assistant message, so nothing to learn")
    return messages


def _parse(line: bytes, where: str):
    try:
        return json.loads(line.decode("utf-8"), parse_constant=safe_files._no_constant)
    except UnicodeDecodeError as error:
        raise RecordError(f"{where}: not UTF-8 text (byte {error.start} of the line)") from None
    except RecursionError:
        raise RecordError(f"{where}: the record nests too deeply to parse") from None
    except ValueError as error:
        raise RecordError(f"{where}: not valid JSON ({printable(str(error))[:200]})") from None


def read_records(path: str, option: str = "data.path"):
    """(where, record) of every record of a local .jsonl, .json or .parquet file, in order;
    `option`: what the user gave the file as, for the messages."""
    if not path:
        raise DataError(f"data.task=chat needs {option}: a local .jsonl, .json or .parquet file of conversations")
    if "://" in path:
        raise DataError(f"{option} {path!r}: chat data is read from local files only; copy it here first")
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{option} {path!r} is not .jsonl, .json or .parquet; chat data comes in one of those")
    if os.path.islink(path):
        raise DataError(f"{option} {path!r} is a symlink; triax reads chat data from the file itself (give the "
                        f"link's target, {printable(os.path.realpath(path))!r})")
    try:
        handle = safe_files.open_read(path, {".json": MAX_JSON_BYTES, ".parquet": MAX_PARQUET_BYTES}.get(extension))
    except FileNotFoundError:
        raise DataError(f"{option} {path!r} does not exist") from None
    except OSError as error:
        raise DataError(f"{option} {path!r} cannot be read: {printable(str(error))}") from None
    with handle:
        if extension == ".jsonl":
            number = 0
            while True:
                line = handle.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return
                number += 1
                where = f"{path}:{number}"
                if len(line) > MAX_LINE_BYTES:
                    raise RecordError(f"{where}: the line is longer than {MAX_LINE_BYTES} bytes; not one conversation")
                if line.strip():
                    yield where, _parse(line, where)
        elif extension == ".json":
            records = _parse(handle.read(MAX_JSON_BYTES + 1), path)
            if not isinstance(records, list):
                raise RecordError(f"{path}: a .json chat file holds a list of records, got {type(records).__name__}")
            for number, record in enumerate(records):
                yield f"{path}: record {number}", record
        else:
            yield from _parquet_records(handle, path)


def _parquet_records(handle: IO[bytes], path: str):
    try:
        import pyarrow  # deferred: an optional dependency, for Parquet files only
        import pyarrow.parquet as parquet
    except ImportError:
        raise MissingDependency(f"{path!r} is Parquet, which needs pyarrow: pip install pyarrow "
                                "(or convert it to JSONL)") from None
    # Arrow is given the file's bytes, never the Python file object, and reads on this thread
    # alone: with a file object its I/O threads call back into Python to read, and one doing so
    # while the interpreter shuts down (after a refusal below, say) aborts the process
    # ("terminate called without an active exception", exit 134).
    size = os.fstat(handle.fileno()).st_size  # checked against MAX_PARQUET_BYTES when it was opened
    data = pyarrow.py_buffer(handle.read(size + 1))  # a buffer the file's size, not the most it may be
    if data.size > MAX_PARQUET_BYTES:
        raise DataError(f"{path!r} is more than {MAX_PARQUET_BYTES} bytes; split it into smaller Parquet files")
    try:
        # ParquetFile, not read_table: read_table's dataset scanner starts an I/O thread even
        # with use_threads=False.
        table = parquet.ParquetFile(pyarrow.BufferReader(data), pre_buffer=False)
        rows = table.metadata.num_rows
    except Exception as error:  # pyarrow's many error classes: the file is not Parquet it can read
        raise DataError(f"{path!r} is not a Parquet file pyarrow can read ({printable(str(error))[:200]})") from None
    # The row count from the footer, before any row is expanded: a few kilobytes of dictionary- and
    # run-length-encoded rows can stand for millions of records, each a Python dict once read.
    if rows > MAX_PARQUET_ROWS:
        raise DataError(f"{path!r} holds {rows} rows, more than the {MAX_PARQUET_ROWS} records triax reads from "
                        "one Parquet file; split it into smaller files")
    number = 0
    batches = table.iter_batches(batch_size=PARQUET_BATCH_ROWS, use_threads=False)
    while True:
        try:
            batch = next(batches, None)
        except Exception as error:  # noqa: BLE001 - as above: damage found while reading the rows
            raise DataError(f"{path!r}: row {number} cannot be read ({printable(str(error))[:200]})") from None
        if batch is None:
            return
        if batch.nbytes > MAX_PARQUET_BATCH_BYTES:
            raise DataError(f"{path!r}: rows {number}..{number + batch.num_rows - 1} hold {batch.nbytes} bytes, more "
                            f"than {PARQUET_BATCH_ROWS} conversations can; the file is damaged or not chat data")
        for record in batch.to_pylist():
            yield f"{path}: row {number}", record
            number += 1


class ChatEncoder:
    """Conversations -> Examples with a chat template and a `tokenizers` tokenizer."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer):
        self.template = template
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer

    def answer_spans(self, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
        """Character spans of the answers, for a template without generation tags."""
        spans = []
        for number, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, _ = self.template.render(messages[:number], add_generation_prompt=True)
            through, _ = self.template.render(messages[:number + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise TemplateError(f"{where}: the chat template of {self.template.origin} has no {{% generation %}} "
                                    "tags and renders a conversation's first turns differently from the whole, so "
                                    "its answers cannot be found; use a template with generation tags")
            spans.append((len(before), len(through)))
        return spans

    def check_learns_to_stop(self) -> None:
        """Refuse a template whose answer span ends with the answer's text: nothing after it (no
        end-of-turn marker) is learned, so the trained model never learns to stop."""
        probe = "triax probe answer"
        messages = [{"role": "user", "content": "triax probe question"}, {"role": "assistant", "content": probe}]
        try:
            text, spans = self.template.render(messages)
            if not self.template.has_generation_tags:
                spans = self.answer_spans(messages, text, self.template.origin)
        except TemplateBoundError:
            raise  # past a bound already: the records would only pass it again
        except TemplateError:
            return  # a template that needs another shape of conversation: judged on the records themselves
        answers = [text[start:end] for start, end in spans if probe in text[start:end]]
        if answers and all(not answer[answer.rindex(probe) + len(probe):].strip() for answer in answers):
            raise TemplateError(f"the chat template of {self.template.origin} ends an answer with its text alone: no "
                                "end-of-turn marker (such as eos_token) follows it within the answer, so the model "
                                "would never learn to stop; put the marker inside {% generation %}")

    def encode(self, messages: list[dict], where: str) -> Example:
        text, spans = self.template.render(messages)
        if not self.template.has_generation_tags:
            spans = self.answer_spans(messages, text, where)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return Example(list(encoding.ids), assistant_mask(encoding.offsets, spans))

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        """The ids that ask the model for the next assistant turn (`triax generate --chat`)."""
        text, _ = self.template.render(messages, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def assistant_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap an answer span (transformers' rule: a token cut by
    the span's edge counts). Spans and offsets are both in order: one pass."""
    mask = [0] * len(offsets)
    span = 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask


@dataclass
class EncodedSplit:
    examples: list[Example]
    truncated: int = 0
    dropped: int = 0  # longer than the block (overlong=drop) or without an answer token left


def encode_records(records: Iterable[tuple[str, Any]], encoder: ChatEncoder, block_size: int,
                   overlong: str) -> EncodedSplit:
    """Every record encoded; one longer than block_size + 1 tokens cut or dropped as `overlong` says."""
    split = EncodedSplit([])
    for where, record in records:
        example = encoder.encode(record_messages(record, where), where)
        cut = len(example.ids) > block_size + 1
        if cut and overlong == "drop":
            split.dropped += 1
            continue
        if cut:
            example = Example(example.ids[:block_size + 1], example.mask[:block_size + 1])
        if not any(example.mask[1:]):  # no answer token left to predict
            split.dropped += 1
            continue
        split.truncated += cut
        split.examples.append(example)
    return split


def shifted(example: Example) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one example: each token predicts the next; targets outside the answers ignored."""
    ids = np.asarray(example.ids, dtype=np.int64)
    mask = np.asarray(example.mask, dtype=bool)
    targets = np.where(mask[1:], ids[1:], IGNORE_INDEX)
    return ids[:-1], targets


def pack(examples: list[Example], block_size: int) -> list[list[int]]:
    """Rows of example numbers, in order, each row's examples fitting block_size inputs together
    (an example is added to the current row while it fits, else starts the next)."""
    rows, current, used = [], [], 0
    for number, example in enumerate(examples):
        length = len(example.ids) - 1
        if current and used + length > block_size:
            rows.append(current)
            current, used = [], 0
        current.append(number)
        used += length
    if current:
        rows.append(current)
    return rows


class ChatDataset(torch.utils.data.Dataset):
    """Rows of block_size inputs and targets: one example each, padded (pad_id, target ignored), or
    several packed. `document_ids(indices)`: for each position, which example of its row it
    belongs to (padding: -1), so the model confines attention and positions to it."""

    sliding_windows = False  # each row is scored whole by evaluation
    answers_only = True  # the targets are the answers' tokens: what a count of scored tokens counts

    def __init__(self, examples: list[Example], block_size: int, packing: bool, pad_id: int = 0,
                 batch_padding: bool = False):
        self.block_size = block_size
        self.packing = packing
        self.examples = examples
        # batch_padding: a batch is cut to its longest row (rounded up to `multiple`, tensor
        # parallelism's split of the sequence); the columns cut hold padding alone, no target.
        self.batch_padding = batch_padding
        self.multiple = 1
        rows = pack(examples, block_size) if packing else [[number] for number in range(len(examples))]
        count = len(rows)
        self.inputs = np.full((count, block_size), pad_id, dtype=np.int64)
        self.targets = np.full((count, block_size), IGNORE_INDEX, dtype=np.int64)
        self.documents = np.full((count, block_size), -1, dtype=np.int64)
        for row, numbers in enumerate(rows):
            position = 0
            for document, number in enumerate(numbers):
                inputs, targets = shifted(examples[number])
                end = position + len(inputs)
                self.inputs[row, position:end] = inputs
                self.targets[row, position:end] = targets
                self.documents[row, position:end] = document
                position = end
        self.lengths = (self.documents >= 0).sum(axis=1)  # each row's positions before its padding

    def _width(self, rows: np.ndarray) -> int:
        if not self.batch_padding or not len(rows):
            return self.block_size
        width = -(-max(int(self.lengths[rows].max()), 1) // self.multiple) * self.multiple
        return min(width, self.block_size)

    def __len__(self) -> int:
        return len(self.inputs)

    def batch(self, indices: torch.Tensor):
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        width = self._width(rows)
        return torch.from_numpy(self.inputs[rows, :width]), torch.from_numpy(self.targets[rows, :width])

    def document_ids(self, indices: torch.Tensor) -> torch.Tensor:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        return torch.from_numpy(self.documents[rows, :self._width(rows)])

    def __getitem__(self, index: int):
        x, y = self.batch(torch.tensor([index]))
        return x[0], y[0]

    def answer_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def chat_template_for(name: str | None, description: dict[str, str], origin: str) -> ChatTemplate:
    """data.chat_template's built-in template, else the checkpoint's: chat_template.jinja or
    tokenizer_config.json's chat_template, with its special tokens (`description`: {file name:
    path} of the checkpoint's tokenizer files, as model.init_from found them)."""
    config = {}
    if "tokenizer_config.json" in description:
        try:
            config = safe_files.read_json(description["tokenizer_config.json"])
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
            raise DataError(f"cannot read {description['tokenizer_config.json']} ({type(error).__name__}: "
                            f"{printable(str(error))[:200]})") from None
        if not isinstance(config, dict):
            raise DataError(f"{description['tokenizer_config.json']} must hold a JSON object")
    special = special_tokens_of(config)
    if name is not None:
        if name not in BUILTIN_TEMPLATES:
            raise DataError(f"data.chat_template={printable(name)!r} is not a built-in template; use one of "
                            f"{', '.join(BUILTIN_TEMPLATES)}, or leave it unset for the checkpoint's own")
        return ChatTemplate(BUILTIN_TEMPLATES[name], f"the built-in template {name!r}", special)
    if "chat_template.jinja" in description:
        path = description["chat_template.jinja"]
        try:
            source = safe_files.read_text(path)
        except (OSError, UnicodeDecodeError) as error:
            raise DataError(f"cannot read {path} ({type(error).__name__}: {printable(str(error))[:200]})") from None
        return ChatTemplate(source, path, special)
    source = template_of_config(config, description.get("tokenizer_config.json", origin))
    if source is None:
        raise DataError(f"{origin} has no chat template (neither chat_template.jinja nor tokenizer_config.json's "
                        "chat_template); name a built-in one: data.chat_template=chatml")
    return ChatTemplate(source, description["tokenizer_config.json"], special)


@dataclass
class ChatData:
    train: ChatDataset
    val: ChatDataset
    report: str  # what was read, cut and dropped, for the run's log



def training_count(count: int, train_split: float) -> int:
    """How many of `count` records train when the tail of the file validates (as for text): the
    train_split share, at least one left to validate. The one rule for chat and preference data,
    in training and in `triax tokenize`."""
    return min(count - 1, int(count * train_split))

def load_chat_datasets(path: str, val_path: str | None, train_split: float, encoder: ChatEncoder,
                       block_size: int, packing: bool, overlong: str, batch_padding: bool = False) -> ChatData:
    """Train and validation rows of data.path (and data.val_path, else its tail fraction)."""
    if overlong not in OVERLONG_RULES:
        raise DataError(f"data.overlong={printable(str(overlong))!r}; use one of {', '.join(OVERLONG_RULES)}")
    encoder.check_learns_to_stop()
    train = encode_records(read_records(path), encoder, block_size, overlong)
    if val_path:
        val = encode_records(read_records(val_path, "data.val_path"), encoder, block_size, overlong)
    else:
        # The tail of the file validates (as for text): a fixed set, whatever the process count.
        keep = training_count(len(train.examples), train_split)
        val = EncodedSplit(train.examples[keep:])
        train = EncodedSplit(train.examples[:keep], train.truncated, train.dropped)
    for name, split, source in (("training", train, path), ("validation", val, val_path or path)):
        if not split.examples:
            raise DataError(f"{source!r} leaves no {name} example with an answer token within data.block_size="
                            f"{block_size}; add records, raise block_size or use data.overlong=truncate")
    report = (f"chat data: {len(train.examples)} training / {len(val.examples)} validation conversations"
              f"{', packed' if packing else ', one per row'}; {train.truncated + val.truncated} cut to "
              f"data.block_size, {train.dropped + val.dropped} dropped (longer than the block with "
              "data.overlong=drop, or no answer token left)")
    return ChatData(ChatDataset(train.examples, block_size, packing, batch_padding=batch_padding),
                    ChatDataset(val.examples, block_size, packing, batch_padding=batch_padding), report)
