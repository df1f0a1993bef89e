"""Build the datasets a training config asks for."""

from __future__ import annotations

from dataclasses import dataclass

from triax.data import AdditionDataset, Vocabulary, load_char_datasets
from triax.train.config import DataConfig


@dataclass
class TrainData:
    train: object  # a dataset with __len__ and batch(indices) -> (x, y)
    val: object
    vocab_size: int
    block_size: int
    vocab: Vocabulary | None  # characters, for the char task; None for addition


def build_data(config: DataConfig) -> TrainData:
    if config.task == "addition":
        train = AdditionDataset(config.digits, "train")
        test = AdditionDataset(config.digits, "test")
        return TrainData(train, test, train.vocab_size, train.block_size, None)
    train, val, vocab = load_char_datasets(config.path, config.block_size, config.train_split,
                                           config.truncate)
    return TrainData(train, val, len(vocab), config.block_size, vocab)
