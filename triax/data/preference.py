"""Preference pairs (data.task=preference): local JSONL, JSON or Parquet files of records, each a
prompt and two answers to it, `chosen` (preferred) and `rejected`, for DPO (triax.objectives.dpo).

A record is TRL's preference format, in any of its four forms:
- conversational, explicit prompt: {"prompt": [messages], "chosen": [messages], "rejected": [messages]};
- conversational, implicit prompt: {"chosen": [whole conversation], "rejected": [whole conversation]},
  the prompt being the messages the two share from the start;
- standard (text), explicit prompt: {"prompt": "...", "chosen": "...", "rejected": "..."};
- standard, implicit prompt: {"chosen": "...", "rejected": "..."}, the prompt being the text the
  two share from the start (TRL's extract_prompt: a space just before the split goes to the answers).

Tokenized as TRL's DPOTrainer tokenizes them: a conversational prompt is rendered with the chat
template and the generation prompt, and each answer is the rest of the rendering of prompt and
answer together; standard text is encoded as the tokenizer encodes text (its special tokens
added), each answer ending with the eos token (added when missing). Where the prompt's ids are
not a prefix of the whole's, the answer starts where they part (TRL's common-prefix rule). A
sequence (prompt and answer) longer than data.block_size tokens is cut as TRL's max_length cuts it
(keep_start: its end goes; keep_end: its start goes); with keep_start a pair whose prompt alone
fills the block is left out, as TRL leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TYPE_CHECKING

import numpy as np
import torch

from triax import safe_files
from triax.data.targets import IGNORE_INDEX
from triax.data.chat import (MAX_DEPTH, RecordError, _depth, _messages, _text, chat_template_for, read_records,
                             training_count)
from triax.data.chat_template import TemplateError, special_tokens_of
from triax.data.errors import DataError
from triax.data.length_rules import TRUNCATION_MODES
from triax.errors import printable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from triax.data.chat_template import ChatTemplate


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]  # the chosen answer's ids, after the prompt's
    rejected: list[int]


def _shared_prefix(chosen: Sequence[int], rejected: Sequence[int]):
    """TRL's extract_prompt on two sequences (texts or message lists): the index where the prompt
    ends. As TRL's loop: where the two first differ, one earlier if a space is just before it; if
    neither differs within the shorter, the shorter's last position."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":
                index -= 1
            break
    return index


def preference_fields(record: object, where: str):
    """(prompt, chosen, rejected) of one record, each text or a list of messages (all alike);
    RecordError naming the field."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if _depth(record, MAX_DEPTH) > MAX_DEPTH:
        raise RecordError(f"{where}: the record nests more than {MAX_DEPTH} levels deep; not a preference pair")
    if "chosen" not in record or "rejected" not in record:
        keys = ", ".join(sorted(printable(str(key))[:40] for key in record)[:8]) or "none"
        raise RecordError(f"{where}: a preference record needs fields 'chosen' and 'rejected' (and 'prompt', or "
                          f"the prompt shared at their start); it has {keys}")
    conversational = isinstance(record["chosen"], list)
    fields = ["prompt", "chosen", "rejected"] if "prompt" in record else ["chosen", "rejected"]
    values = []
    for field in fields:
        value = record[field]
        if conversational:
            values.append(_messages(where, field, value))
        elif isinstance(value, list):
            raise RecordError(f"{where}: field {field!r} is a list of messages but 'chosen' is text; give all "
                              "of prompt, chosen and rejected as text or all as messages")
        else:
            values.append(_text(where, field, value))
    if len(values) == 3:
        prompt, chosen, rejected = values
    else:
        chosen, rejected = values
        if not chosen or not rejected:
            raise RecordError(f"{where}: field {'chosen' if not chosen else 'rejected'!r} is empty")
        split = _shared_prefix(chosen, rejected)
        prompt, chosen, rejected = chosen[:split], chosen[split:], rejected[split:]
    _check_answers(where, chosen, rejected)
    return prompt, chosen, rejected


def _check_answers(where: str, chosen: object, rejected: object) -> None:
    """Each answer says something, and a conversational one ends with the assistant's turn: an empty
    answer or one in the user's role would train the model to prefer nothing, or the user's words."""
    for field, answer in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(answer, list):
            if answer and answer[-1].get("role") != "assistant":
                raise RecordError(f"{where}: field {field!r} ends with a {printable(str(answer[-1].get('role')))[:20]!r}"
                                  " message; an answer is the assistant's turn")
            if not answer or not any(str(message.get("content") or "").strip() for message in answer):
                raise RecordError(f"{where}: field {field!r} holds no answer (no message with content)")
        elif not str(answer).strip():
            raise RecordError(f"{where}: field {field!r} is empty; an answer says something")


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


class PreferenceEncoder:
    """Records -> Pairs with a `tokenizers` tokenizer and, for conversational records, a chat template.
    `no_template`: why there is no template (raised at the first conversational record), else None."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None = None, eos_token: str | None = None,
                 no_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.eos_token = eos_token
        self.no_template = no_template

    def _ids(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        if self.template is None:
            raise DataError(self.no_template or "conversational preference records need a chat template")
        text, _ = self.template.render(messages, add_generation_prompt=generation_prompt)
        return self._ids(text, special=False)  # the template writes the special tokens it wants

    def encode(self, record: object, where: str) -> Pair:
        prompt, chosen, rejected = preference_fields(record, where)
        if isinstance(chosen, list):
            prompt_ids = self._render(prompt, generation_prompt=True)
            chosen_ids, rejected_ids = self._render(prompt + chosen), self._render(prompt + rejected)
        else:
            if self.eos_token is None:
                raise DataError(f"{where}: text preference records end each answer with the eos token, and the "
                                "checkpoint's tokenizer_config.json names none; give it an eos_token")
            chosen = chosen if chosen.endswith(self.eos_token) else chosen + self.eos_token
            rejected = rejected if rejected.endswith(self.eos_token) else rejected + self.eos_token
            prompt_ids = self._ids(prompt, special=True)
            chosen_ids, rejected_ids = self._ids(prompt + chosen, True), self._ids(prompt + rejected, True)
        cut = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
        return Pair(prompt_ids[:cut], chosen_ids[cut:], rejected_ids[cut:])


@dataclass
class EncodedPairs:
    pairs: list[Pair]
    truncated: int = 0  # pairs with a sequence cut to the block
    dropped: int = 0  # keep_start: the prompt alone fills the block


def encode_pairs(records: Iterable[tuple[str, Any]], encoder: PreferenceEncoder, max_length: int,
                 truncation: str) -> EncodedPairs:
    """Every record encoded; pairs whose prompt fills max_length left out under keep_start (as TRL)."""
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"data.truncation_mode={printable(str(truncation))!r}; use one of {', '.join(TRUNCATION_MODES)}")
    split = EncodedPairs([])
    for where, record in records:
        pair = encoder.encode(record, where)
        if truncation == "keep_start" and len(pair.prompt) >= max_length:
            split.dropped += 1
            continue
        split.truncated += len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) > max_length
        split.pairs.append(pair)
    return split


def sequence(pair: Pair, answer: list[int], max_length: int, truncation: str) -> tuple[list[int], list[int]]:
    """(ids, answer mask) of prompt + answer cut to max_length as TRL's collator cuts them."""
    ids, mask = pair.prompt + answer, [0] * len(pair.prompt) + [1] * len(answer)
    if len(ids) > max_length:
        cut = slice(None, max_length) if truncation == "keep_start" else slice(-max_length, None)
        ids, mask = ids[cut], mask[cut]
    return ids, mask


class PreferenceDataset(torch.utils.data.Dataset):
    """The pairs, one sample each. `batch(indices)` gives (inputs, targets) of 2 x len(indices) rows,
    the chosen sequences then the rejected ones (TRL's order), padded to the longest row of the
    batch (`multiple`: to a multiple of it) with pad_id and no target; a target is the next token
    where it belongs to the answer, IGNORE_INDEX elsewhere. A row's summed target log-probabilities
    are its answer's log-probability, which padding after it cannot change (causal attention)."""

    sliding_windows = False
    preference = True

    def __init__(self, pairs: list[Pair], max_length: int, truncation: str, pad_id: int = 0, multiple: int = 1):
        self.pairs = pairs
        self.max_length = max_length
        self.truncation = truncation
        self.pad_id = pad_id
        self.multiple = multiple

    def __len__(self) -> int:
        return len(self.pairs)

    def rows(self, indices: Sequence[int]) -> list[tuple[list[int], list[int]]]:
        chosen, rejected = [], []
        for index in np.asarray(indices, dtype=np.int64).reshape(-1).tolist():
            pair = self.pairs[index]
            chosen.append(sequence(pair, pair.chosen, self.max_length, self.truncation))
            rejected.append(sequence(pair, pair.rejected, self.max_length, self.truncation))
        return chosen + rejected

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows(indices)
        width = max(max(len(ids) for ids, _ in rows) - 1, 1)
        width = -(-width // self.multiple) * self.multiple
        inputs = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        for row, (ids, mask) in enumerate(rows):
            ids_array = np.asarray(ids, dtype=np.int64)
            inputs[row, :len(ids) - 1] = ids_array[:-1]
            targets[row, :len(ids) - 1] = np.where(np.asarray(mask[1:], dtype=bool), ids_array[1:], IGNORE_INDEX)
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def __getitem__(self, index: int):
        x, y = self.batch([index])
        return x, y

    def answer_tokens(self) -> int:
        """The tokens the loss sees: every answer token after the first position of its row."""
        return sum(sum(mask[1:]) for index in range(len(self.pairs)) for _, mask in self.rows([index]))


@dataclass
class PreferenceData:
    train: PreferenceDataset
    val: PreferenceDataset
    report: str  # what was read, cut and dropped, for the run's log


def identical_note(pairs: list[Pair]) -> str:
    """Pairs whose chosen answer is the rejected one teach nothing (their DPO loss is log 2 whatever
    the model does): accepted, as TRL accepts them, but counted where the data is reported."""
    identical = sum(pair.chosen == pair.rejected for pair in pairs)
    return f"; {identical} with chosen identical to rejected (nothing to learn from them)" if identical else ""


def load_preference_datasets(path: str | None, val_path: str | None, train_split: float, encoder: PreferenceEncoder,
                             max_length: int, truncation: str, multiple: int = 1) -> PreferenceData:
    """Train and validation pairs of data.path (and data.val_path, else the tail of data.path)."""
    if not path:
        raise DataError("data.task=preference needs data.path: a local .jsonl, .json or .parquet file of "
                        "prompt/chosen/rejected records")
    train = encode_pairs(read_records(path), encoder, max_length, truncation)
    if val_path:
        val = encode_pairs(read_records(val_path, "data.val_path"), encoder, max_length, truncation)
    else:
        keep = training_count(len(train.pairs), train_split)
        val = EncodedPairs(train.pairs[keep:])
        train = EncodedPairs(train.pairs[:keep], train.truncated, train.dropped)
    for name, split, source in (("training", train, path), ("validation", val, val_path or path)):
        if not split.pairs:
            raise DataError(f"{source!r} leaves no {name} pair whose prompt fits data.block_size={max_length}; add "
                            "records or raise data.block_size")
    report = (f"preference data: {len(train.pairs)} training / {len(val.pairs)} validation pairs; "
              f"{train.truncated + val.truncated} with a sequence cut to data.block_size ({truncation}), "
              f"{train.dropped + val.dropped} left out (the prompt alone fills the block)"
              + identical_note(train.pairs + val.pairs))
    return PreferenceData(PreferenceDataset(train.pairs, max_length, truncation, multiple=multiple),
                          PreferenceDataset(val.pairs, max_length, truncation, multiple=multiple), report)


def preference_encoder_for(chat_template: str | None, description: dict[str, str], origin: str,
                           tokenizer: Tokenizer) -> PreferenceEncoder:
    """The encoder of a checkpoint (`description`: its tokenizer files, as model.init_from found
    them): its chat template for conversational records (a checkpoint without one can still encode
    text records) and its eos token for text ones."""
    template, no_template = None, None
    try:
        template = chat_template_for(chat_template, description, origin)
    except TemplateError:
        raise  # a template that is there but hostile or broken is refused at once
    except DataError as error:
        no_template = f"conversational preference records need a chat template: {error}"
    special = template.special_tokens if template is not None else _special_tokens(description)
    return PreferenceEncoder(tokenizer, template, special.get("eos_token"), no_template)


def _special_tokens(description: dict[str, str]) -> dict[str, str]:
    if "tokenizer_config.json" not in description:
        return {}
    try:
        config = safe_files.read_json(description["tokenizer_config.json"])
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as error:
        raise DataError(f"cannot read {description['tokenizer_config.json']} ({type(error).__name__}: "
                        f"{printable(str(error))[:200]})") from None
    return special_tokens_of(config) if isinstance(config, dict) else {}
