"""Prompt data for GRPO: TRL's prompt-only records in local JSONL, JSON or Parquet files, read by
the chat path's checked reader (triax.data.chat.read_records: sizes, links, encodings, one line per
bad record naming the file, the line and the field).

A record is {"prompt": "text"} or {"prompt": [{"role": ..., "content": ...}, ...]} (conversational),
with any other fields, which are handed to the reward functions by name, one value per completion
(an `answer` for exact_match). Tokenized as TRL's GRPOTrainer tokenizes prompts: text as the
tokenizer encodes text (its special tokens added), a conversation rendered with the chat template
and the generation prompt (the template writes its own special tokens). A prompt that leaves no room
for grpo.max_completion_length tokens in the model's context (data.block_size) is left out and
counted in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TYPE_CHECKING

import numpy as np

from triax import safe_files
from triax.data.chat import (MAX_DEPTH, RecordError, _depth, _messages, _text, chat_template_for, read_records,
                             training_count)
from triax.data.chat_template import TemplateError
from triax.data.errors import DataError
from triax.data.preference import preference_encoder_for
from triax.errors import printable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from triax.data.chat_template import ChatTemplate

# Names the reward functions are called with besides the records' fields (TRL passes the same).
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


@dataclass
class Prompt:
    ids: list[int]
    prompt: str | list[dict]  # as the record gives it: what the reward functions see
    columns: dict[str, Any]  # the record's other fields
    where: str  # file:line, for messages


def prompt_fields(record: object, where: str) -> tuple[str | list[dict], dict[str, Any]]:
    """(prompt, other fields) of one record; RecordError naming the field."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if _depth(record, MAX_DEPTH) > MAX_DEPTH:
        raise RecordError(f"{where}: the record nests more than {MAX_DEPTH} levels deep; not a prompt record")
    if record.get("prompt") is None:
        keys = ", ".join(sorted(printable(str(key))[:40] for key in record)[:8]) or "none"
        raise RecordError(f"{where}: a prompt record needs field 'prompt' (text or a list of messages); it has {keys}")
    prompt = record["prompt"]
    if isinstance(prompt, list):
        prompt = _messages(where, "prompt", prompt)
    elif not _text(where, "prompt", prompt).strip():
        raise RecordError(f"{where}: field 'prompt' is empty")
    columns = {key: value for key, value in record.items() if key != "prompt"}
    for key in columns:
        if key in RESERVED_COLUMNS:
            raise RecordError(f"{where}: field {key!r} has the name of an argument the reward functions are given; "
                              "rename it")
    return prompt, columns


class PromptEncoder:
    """Prompts -> ids as TRL's GRPOTrainer makes them. `template`: the chat template (None: the
    checkpoint has none, `no_template` says why, raised at the first conversational record)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, no_template: str | None = None,
                 eos_token: str | None = None, generation_ends: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.template = template
        self.no_template = no_template
        self.eos_token = eos_token  # where a completion ends (the checkpoint's eos token)
        self.generation_ends = generation_ends  # and the ids generation_config.json ends at

    def encode(self, prompt: str | list[dict], where: str) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)
        if self.template is None:
            raise DataError(f"{where}: a conversational prompt needs a chat template: {self.no_template}")
        text, _ = self.template.render(prompt, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass
class EncodedPrompts:
    prompts: list[Prompt]
    dropped: int = 0  # no room for a completion in the context


def encode_prompts(records: Iterable[tuple[str, Any]], encoder: PromptEncoder, longest_prompt: int) -> EncodedPrompts:
    """Every record encoded; a prompt of more than `longest_prompt` tokens left out (counted)."""
    split = EncodedPrompts([])
    for where, record in records:
        prompt, columns = prompt_fields(record, where)
        ids = encoder.encode(prompt, where)
        if not ids:
            raise RecordError(f"{where}: field 'prompt' encodes to no tokens")
        if len(ids) > longest_prompt:
            split.dropped += 1
            continue
        split.prompts.append(Prompt(ids, prompt, columns, where))
    return split


class PromptDataset:
    """The prompts, one sample each; `records(indices)` gives them in the order asked. Every record
    has every column: one a record lacks is None for it (as a table of the records would hold)."""

    produced = True  # a step's batch is produced from these samples (the rollout), not read from them

    def __init__(self, prompts: list[Prompt], encoder: PromptEncoder | None = None):
        self.prompts = prompts
        self.encoder = encoder
        self.column_names = sorted({key for prompt in prompts for key in prompt.columns})

    def __len__(self) -> int:
        return len(self.prompts)

    def records(self, indices: Sequence[int]) -> list[Prompt]:
        return [self.prompts[index] for index in np.asarray(indices, dtype=np.int64).reshape(-1).tolist()]

    def columns(self, prompts: Sequence[Prompt], repeat: int) -> dict[str, list]:
        """Each column's values for the completions of `prompts`, `repeat` per prompt (TRL's order)."""
        return {name: [prompt.columns.get(name) for prompt in prompts for _ in range(repeat)]
                for name in self.column_names}


@dataclass
class PromptData:
    train: PromptDataset
    val: PromptDataset
    report: str  # what was read and left out, for the run's log


def load_prompt_datasets(path: str | None, val_path: str | None, train_split: float, encoder: PromptEncoder,
                         block_size: int, max_completion_length: int) -> PromptData:
    """Train and validation prompts of data.path (and data.val_path, else the tail of data.path)."""
    if not path:
        raise DataError("data.task=grpo needs data.path: a local .jsonl, .json or .parquet file of prompt records")
    longest = block_size - max_completion_length
    if longest < 1:
        raise DataError(f"grpo.max_completion_length={max_completion_length} leaves no room for a prompt in "
                        f"data.block_size={block_size}; raise block_size or lower max_completion_length")
    train = encode_prompts(read_records(path), encoder, longest)
    if val_path:
        val = encode_prompts(read_records(val_path, "data.val_path"), encoder, longest)
    else:
        keep = training_count(len(train.prompts), train_split)
        val = EncodedPrompts(train.prompts[keep:])
        train = EncodedPrompts(train.prompts[:keep], train.dropped)
    for name, split, source in (("training", train, path), ("validation", val, val_path or path)):
        if not split.prompts:
            raise DataError(f"{source!r} leaves no {name} prompt of at most {longest} tokens (data.block_size="
                            f"{block_size} less grpo.max_completion_length={max_completion_length}); add records, "
                            "raise block_size or lower max_completion_length")
    report = (f"prompt data: {len(train.prompts)} training / {len(val.prompts)} validation prompts; "
              f"{train.dropped + val.dropped} left out (longer than {longest} tokens)")
    return PromptData(PromptDataset(train.prompts, encoder), PromptDataset(val.prompts, encoder), report)


def prompt_encoder_for(chat_template: str | None, description: dict[str, str], origin: str,
                       tokenizer: Tokenizer) -> PromptEncoder:
    """The encoder of a checkpoint (`description`: its tokenizer files, as model.init_from found
    them): its chat template for conversational prompts (a checkpoint without one can still encode
    text prompts)."""
    # The eos token as DPO's data reads it: the template's, else tokenizer_config.json's.
    eos_token = preference_encoder_for(chat_template, description, origin, tokenizer).eos_token
    ends = generation_ends(description, tokenizer.get_vocab_size())
    try:
        return PromptEncoder(tokenizer, chat_template_for(chat_template, description, origin), None, eos_token, ends)
    except TemplateError:
        raise  # a template that is there but hostile or broken is refused at once
    except DataError as error:
        return PromptEncoder(tokenizer, None, str(error), eos_token, ends)


def generation_ends(description: dict[str, str], vocab_size: int) -> tuple[int, ...]:
    """The ids generation_config.json's eos_token_id names (an id or a list of them), where
    transformers' generate, and so TRL's GRPOTrainer, also ends a completion: Llama 3's instruct
    models end a turn at <|eot_id|> and <|eom_id|> besides <|end_of_text|>, Qwen2.5's at
    <|endoftext|> besides <|im_end|>. None of them without the file."""
    path = description.get("generation_config.json")
    if path is None:
        return ()
    try:
        ids = safe_files.read_json(path).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as error:
        raise DataError(f"cannot read {path} ({type(error).__name__}: {printable(str(error))[:200]}); "
                        "fix or remove the checkpoint's generation_config.json") from None
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if len(ids) > 64 or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
        raise DataError(f"{path}: eos_token_id={printable(repr(ids))[:200]} must be a token id below the vocabulary's "
                        f"{vocab_size}, or a list of at most 64 of them; fix the checkpoint's generation_config.json")
    return tuple(ids)
