"""Random state that every process must share: Accelerate's synchronize_rng_states and
SeedableRandomSampler, on torch.distributed.

A shuffled dataloader draws its order from a generator; when every process holds process 0's
generator state, every process draws the same order, which is the order one process would draw.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import RandomSampler

from triax.accelerate._internal.errors import AcceleratorValueError
from triax.runtime.collectives_at_exit import wait_and_keep
from triax.runtime.process_group import collective_device, is_distributed

# Accelerate's rng_types that exist on triax's devices; its other accelerators' types are refused.
RNG_TYPES = ("torch", "cuda", "generator")


def _broadcast_state(state: torch.Tensor, from_process: int = 0) -> torch.Tensor:
    """Process `from_process`'s RNG state (a uint8 tensor of the same size everywhere)."""
    if not is_distributed():
        return state
    moved = state.to(collective_device())
    wait_and_keep(dist.broadcast(moved, src=from_process, async_op=True))
    return moved.cpu()


def synchronize_generator(generator: torch.Generator, from_process: int = 0) -> None:
    """Give `generator` process `from_process`'s state on every process (a collective)."""
    generator.set_state(_broadcast_state(generator.get_state(), from_process))


def synchronize_rng_state(rng_type: str, generator: torch.Generator | None = None) -> None:
    name = str(getattr(rng_type, "value", rng_type))
    if name == "torch":
        torch.set_rng_state(_broadcast_state(torch.get_rng_state()))
    elif name == "cuda":
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(_broadcast_state(torch.cuda.get_rng_state()))
    elif name == "generator":
        if generator is None:
            raise AcceleratorValueError("synchronize_rng_states(['generator']) needs generator=<torch.Generator>")
        synchronize_generator(generator)
    else:
        raise AcceleratorValueError(f"rng type {name!r} is not available in triax; use one of {', '.join(RNG_TYPES)}")


def synchronize_rng_states(rng_types: list, generator: torch.Generator | None = None) -> None:
    """Every process takes process 0's state of each named RNG ("torch", "cuda", "generator")."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order is a function of (seed, epoch), as Accelerate's: each pass
    reseeds the generator with initial_seed + epoch, then moves to the next epoch. initial_seed
    is data_seed, else torch's initial seed."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
