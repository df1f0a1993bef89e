"""The models `triax bench` times, with synthetic batches (data loading is not what is measured)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from triax.errors import TriaxError
from triax.models import PRESETS, GPTConfig, build_model

MLP_NAME = "mlp"


@dataclass
class BenchModel:
    name: str
    build: Callable[[], nn.Module]  # a fresh model with the weights of seed 0
    batch: Callable[[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]  # (rank, size, device)
    flops_per_sample: float  # training FLOPs (forward + backward) for one sample
    tokens_per_sample: int | None  # None: not a sequence model
    block_size: int | None = None
    gpt_config: GPTConfig | None = None


def model_names() -> list[str]:
    return [*PRESETS, MLP_NAME]


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy in fp32 whatever the compute dtype (a bf16 softmax loses digits)."""
    return F.cross_entropy(output.float().reshape(-1, output.size(-1)), target.reshape(-1))


def seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    # Every adapter builds its own copy; the same seed gives every copy the same weights.
    torch.manual_seed(0)
    return factory()


def builtin_vocab_size() -> int:
    """The built-in corpus's character vocabulary: the trainer takes its vocabulary from the corpus,
    so the synthetic-data models use the same size and every adapter times the same model."""
    from triax.data import Vocabulary
    from triax.data.text import read_text

    return len(Vocabulary.from_text(read_text(None)))


def make_bench_model(name: str, block_size: int = 128, vocab_size: int | None = None) -> BenchModel:
    if name == MLP_NAME:
        return _mlp()
    if name not in PRESETS:
        raise TriaxError(f"unknown bench model {name!r}; choose one of {', '.join(model_names())}")
    vocab_size = vocab_size or builtin_vocab_size()
    config = GPTConfig.from_preset(name, vocab_size=vocab_size, block_size=block_size)
    def build() -> nn.Module:
        return seeded(lambda: build_model(config))

    def batch(rank: int, size: int, device: torch.device):
        generator = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(vocab_size, (size, block_size + 1), generator=generator)
        return ids[:, :-1].to(device), ids[:, 1:].to(device)

    flops_per_token = _gpt_flops_per_token(config, block_size)
    return BenchModel(name, build, batch, flops_per_token * block_size, block_size, block_size, config)


def _gpt_flops_per_token(config: GPTConfig, block_size: int) -> float:
    with torch.device("meta"):  # no memory, no init: only the parameter count is needed
        model = build_model(config)
    return model.flops_per_token(block_size)


# A small MLP classifier: matmul-bound, no attention, to see the communication share of a plain model.
MLP_WIDTHS = (512, 2048, 2048, 10)


def _mlp() -> BenchModel:
    def factory() -> nn.Module:
        layers: list[nn.Module] = []
        for index, (width_in, width_out) in enumerate(zip(MLP_WIDTHS, MLP_WIDTHS[1:])):
            layers.append(nn.Linear(width_in, width_out))
            if index < len(MLP_WIDTHS) - 2:
                layers.append(nn.GELU())
        return nn.Sequential(*layers)

    def batch(rank: int, size: int, device: torch.device):
        generator = torch.Generator().manual_seed(1000 + rank)
        inputs = torch.randn(size, MLP_WIDTHS[0], generator=generator)
        return inputs.to(device), torch.randint(MLP_WIDTHS[-1], (size,), generator=generator).to(device)

    params = sum(a * b + b for a, b in zip(MLP_WIDTHS, MLP_WIDTHS[1:]))
    return BenchModel(MLP_NAME, lambda: seeded(factory), batch, 6.0 * params, None)
