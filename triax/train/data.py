"""Build the datasets a training config asks for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triax.data import AdditionDataset, load_char_datasets
from triax.data.text import CharDataset, read_text
from triax.data.tokenizer import BPETokenizer, require_checkpoint_tokenizer
from triax.data.mixture import Mixture
from triax.data.sources import open_source
from triax.errors import ConfigError
from triax.objectives.registry import objective_for
from triax.config.schema import DataConfig
from triax.config.validate import source_names


@dataclass
class TrainData:
    train: object  # a dataset with __len__ and batch(indices) -> (x, y)
    val: object
    vocab_size: int
    block_size: int
    vocab: object | None  # encode/decode/len: characters (char), a BPETokenizer (tokens with one), else None
    tokenizer_path: str | None = None  # tokens: the tokenizer.json the run dir gets a copy of
    report: str | None = None  # what the run's log says about the data (chat: conversations cut, dropped)
    # A mixture: each source's validation windows by name, and its weight in the reported val_loss.
    val_sources: dict | None = None
    val_weights: dict | None = None


def build_data(config: DataConfig, codec: object | None = None, source: object | None = None,
               run: object | None = None) -> TrainData:
    """`codec`: the text codec of model.init_from's checkpoint (a tokenizer or a character
    vocabulary); it then encodes data.task=char text instead of a vocabulary of its own.
    `source`: model.init_from's ForeignRun (data.task=chat reads its chat template).
    `run`: the whole TrainConfig, for a task whose objective reads its own records with its own
    keys (triax.objectives.registry)."""
    load_data = objective_for(config.task).load_data
    if load_data is not None:  # the objective's own records, encoded by the checkpoint's tokenizer
        train, val, report = load_data(config, codec, source, run)
        return TrainData(train, val, len(codec), config.block_size, codec, getattr(codec, "source_path", None),
                         report=report)
    if config.task == "chat":
        return _chat_data(config, codec, source)
    if config.task == "char" and codec is not None:
        return _encoded_text(config, codec)
    if config.task == "addition":
        train = AdditionDataset(config.digits, "train")
        test = AdditionDataset(config.digits, "test")
        return TrainData(train, test, train.vocab_size, train.block_size, None)
    if config.task == "tokens" and config.sources:
        return _mixture(config)
    if config.task == "tokens":

        source = open_source(config.path, config.val_path, config.block_size, config.vocab_size,
                             config.token_dtype, config.train_split, config.eot_token)
        _pack_documents(config, [(config.path, source)])
        tokenizer = None
        if source.tokenizer_path is not None:
            tokenizer = BPETokenizer.from_file(source.tokenizer_path)
        return TrainData(source.train, source.val, source.vocab_size, config.block_size, tokenizer,
                         source.tokenizer_path)
    train, val, vocab = load_char_datasets(config.path, config.block_size, config.train_split,
                                           config.truncate)
    return TrainData(train, val, len(vocab), config.block_size, vocab)


def _mixture(config: DataConfig) -> TrainData:
    """data.sources: each source opened in its own format, blended by weight (triax.data.mixture)."""
    names = source_names(config)
    opened = [open_source(source.path, source.val_path, config.block_size, config.vocab_size,
                          config.token_dtype, config.train_split, config.eot_token, key=f"data.sources.{number}")
              for number, source in enumerate(config.sources)]
    _pack_documents(config, [(source.path, opened_source) for source, opened_source in zip(config.sources, opened)])
    mixture = Mixture([source.train for source in opened], [source.weight for source in config.sources], names)
    mixture.packing = config.packing
    # One vocabulary for all: the largest any source records (a source checks its own ids against its own).
    vocab_size = max(source.vocab_size for source in opened)
    tokenizer_path = next((source.tokenizer_path for source in opened if source.tokenizer_path), None)
    tokenizer = BPETokenizer.from_file(tokenizer_path) if tokenizer_path else None
    val_sources = {name: source.val for name, source in zip(names, opened)}
    return TrainData(mixture, opened[0].val, vocab_size, config.block_size, tokenizer, tokenizer_path,
                     val_sources=val_sources, val_weights=dict(zip(names, mixture.weights.tolist())))


def _pack_documents(config: DataConfig, sources: list) -> None:
    """data.packing for token sources: every split's windows get their document numbers."""
    if not config.packing:
        return
    for path, source in sources:
        if source.train.documents is None:
            raise ConfigError(f"data.packing=true needs to know where the documents of {path!r} begin: it is "
                              f"{source.format} tokens with no document index; set data.eot_token (50256 for "
                              "GPT-2's tokens) or use a Megatron dataset")
        for split in (source.train, source.val):
            split.packing, split.score_document_starts = True, config.score_document_starts


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

    require_checkpoint_tokenizer("chat", codec, source,
                                 "its chat template and tokenizer render and encode the conversations")
    template = chat_template_for(config.chat_template, source.description, source.path)
    encoder = ChatEncoder(template, codec.tokenizer)
    chat = load_chat_datasets(config.path, config.val_path, config.train_split, encoder, config.block_size,
                              config.packing, config.overlong, config.batch_padding)
    return TrainData(chat.train, chat.val, len(codec), config.block_size, codec,
                     getattr(codec, "source_path", None), report=chat.report)
