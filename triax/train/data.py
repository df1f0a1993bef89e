"""Build the datasets a training config asks for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triax.data import AdditionDataset, load_char_datasets
from triax.data.text import CharDataset, read_text
from triax.data.tokenizer import BPETokenizer
from triax.data.tokens import load_token_datasets
from triax.errors import ConfigError
from triax.objectives.grpo.prompts import load_prompt_datasets, prompt_encoder_for
from triax.config.schema import DataConfig


@dataclass
class TrainData:
    train: object  # a dataset with __len__ and batch(indices) -> (x, y)
    val: object
    vocab_size: int
    block_size: int
    vocab: object | None  # encode/decode/len: characters (char), a BPETokenizer (tokens with one), else None
    tokenizer_path: str | None = None  # tokens: the tokenizer.json the run dir gets a copy of
    report: str | None = None  # what the run's log says about the data (chat: conversations cut, dropped)


def build_data(config: DataConfig, codec: object | None = None, source: object | None = None,
               max_completion_length: int = 0) -> TrainData:
    """`codec`: the text codec of model.init_from's checkpoint (a tokenizer or a character
    vocabulary); it then encodes data.task=char text instead of a vocabulary of its own.
    `source`: model.init_from's ForeignRun (data.task=chat reads its chat template).
    `max_completion_length`: data.task=grpo, the room a prompt leaves for its completions."""
    if config.task == "grpo":
        return _prompt_data(config, codec, source, max_completion_length)
    if config.task == "chat":
        return _chat_data(config, codec, source)
    if config.task == "preference":
        return _preference_data(config, codec, source)
    if config.task == "char" and codec is not None:
        return _encoded_text(config, codec)
    if config.task == "addition":
        train = AdditionDataset(config.digits, "train")
        test = AdditionDataset(config.digits, "test")
        return TrainData(train, test, train.vocab_size, train.block_size, None)
    if config.task == "tokens":

        train, val, vocab_size, tokenizer_path = load_token_datasets(config.path, config.block_size,
                                                                     config.vocab_size, config.token_dtype)
        tokenizer = None
        if tokenizer_path is not None:

            tokenizer = BPETokenizer.from_file(tokenizer_path)
        return TrainData(train, val, vocab_size, config.block_size, tokenizer, tokenizer_path)
    train, val, vocab = load_char_datasets(config.path, config.block_size, config.train_split,
                                           config.truncate)
    return TrainData(train, val, len(vocab), config.block_size, vocab)


def _encoded_text(config: DataConfig, codec: object) -> TrainData:
    """The text of data.path cut as for task=char, but as ids of `codec`."""


    text = read_text(config.path)
    ids = torch.tensor(codec.encode(text[: int(len(text) * config.truncate)]), dtype=torch.int32)
    split = int(len(ids) * config.train_split)
    if config.block_size >= min(split, len(ids) - split):
        raise ConfigError(f"data.block_size={config.block_size} is not smaller than the text it must cut into "
                          f"windows ({split} training / {len(ids) - split} validation tokens); use a smaller "
                          "block_size or more text")
    train, val = CharDataset(ids[:split], config.block_size, codec), CharDataset(ids[split:], config.block_size, codec)
    return TrainData(train, val, len(codec), config.block_size, codec, getattr(codec, "source_path", None))


def _chat_data(config: DataConfig, codec: object, source: object | None) -> TrainData:
    """Conversations rendered with the checkpoint's chat template and encoded by its tokenizer."""
    from triax.data.chat import ChatEncoder, chat_template_for, load_chat_datasets

    if source is None or not isinstance(codec, BPETokenizer):
        raise ConfigError("data.task=chat needs model.init_from: a transformers checkpoint directory with "
                          "tokenizer.json (its chat template and tokenizer render and encode the conversations)")
    template = chat_template_for(config.chat_template, source.description, source.path)
    encoder = ChatEncoder(template, codec.tokenizer)
    chat = load_chat_datasets(config.path, config.val_path, config.train_split, encoder, config.block_size,
                              config.packing, config.overlong, config.batch_padding)
    return TrainData(chat.train, chat.val, len(codec), config.block_size, codec,
                     getattr(codec, "source_path", None), report=chat.report)


def _preference_data(config: DataConfig, codec: object, source: object | None) -> TrainData:
    """Preference pairs encoded as TRL's DPOTrainer encodes them (triax.data.preference)."""
    from triax.data.preference import load_preference_datasets, preference_encoder_for

    if source is None or not isinstance(codec, BPETokenizer):
        raise ConfigError("data.task=preference needs model.init_from: a transformers checkpoint directory with "
                          "tokenizer.json (its tokenizer and chat template encode the pairs)")
    encoder = preference_encoder_for(config.chat_template, source.description, source.path, codec.tokenizer)
    pairs = load_preference_datasets(config.path, config.val_path, config.train_split, encoder, config.block_size,
                                     config.truncation_mode)
    return TrainData(pairs.train, pairs.val, len(codec), config.block_size, codec,
                     getattr(codec, "source_path", None), report=pairs.report)


def _prompt_data(config: DataConfig, codec: object, source: object | None, max_completion_length: int) -> TrainData:
    """GRPO's prompts, encoded as TRL's GRPOTrainer encodes them (triax.objectives.grpo.prompts)."""
    if source is None or not isinstance(codec, BPETokenizer):
        raise ConfigError("data.task=grpo needs model.init_from: a transformers checkpoint directory with "
                          "tokenizer.json (its tokenizer and chat template encode the prompts)")
    encoder = prompt_encoder_for(config.chat_template, source.description, source.path, codec.tokenizer)
    prompts = load_prompt_datasets(config.path, config.val_path, config.train_split, encoder, config.block_size,
                                   max_completion_length)
    return TrainData(prompts.train, prompts.val, len(codec), config.block_size, codec,
                     getattr(codec, "source_path", None), report=prompts.report)
