"""Build the datasets a training config asks for."""

from __future__ import annotations

from dataclasses import dataclass

from triax.data import AdditionDataset, load_char_datasets
from triax.train.config import DataConfig


@dataclass
class TrainData:
    train: object  # a dataset with __len__ and batch(indices) -> (x, y)
    val: object
    vocab_size: int
    block_size: int
    vocab: object | None  # encode/decode/len: characters (char), a BPETokenizer (tokens with one), else None
    tokenizer_path: str | None = None  # tokens: the tokenizer.json the run dir gets a copy of


def build_data(config: DataConfig) -> TrainData:
    if config.task == "addition":
        train = AdditionDataset(config.digits, "train")
        test = AdditionDataset(config.digits, "test")
        return TrainData(train, test, train.vocab_size, train.block_size, None)
    if config.task == "tokens":
        from triax.data.tokens import load_token_datasets

        train, val, vocab_size, tokenizer_path = load_token_datasets(config.path, config.block_size,
                                                                     config.vocab_size, config.token_dtype)
        tokenizer = None
        if tokenizer_path is not None:
            from triax.data.tokenizer import BPETokenizer

            tokenizer = BPETokenizer.from_file(tokenizer_path)
        return TrainData(train, val, vocab_size, config.block_size, tokenizer, tokenizer_path)
    train, val, vocab = load_char_datasets(config.path, config.block_size, config.train_split,
                                           config.truncate)
    return TrainData(train, val, len(vocab), config.block_size, vocab)
