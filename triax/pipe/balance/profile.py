"""Measuring what each layer costs, on copies of the layers (the module given is left untouched).

* `profile_times`: forward + backward seconds of each layer on a sample batch.
* `profile_sizes`: bytes each layer holds during training — what autograd saves for backward on
  one micro-batch, plus its parameters times `param_scale`. Counting saved tensors instead of
  allocator statistics works the same on every device.
"""

from __future__ import annotations

import copy
import time
from typing import Iterator, TYPE_CHECKING

import torch
from torch import nn

from triax.pipe.errors import PipeValueError
from triax.pipe.microbatch import split, tensors_of, to_device

if TYPE_CHECKING:
    from triax.pipe.microbatch import Batch

__all__: list[str] = []


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Each layer of `module` in turn, as a copy on `device` in training mode (what is profiled)."""
    for layer in module:
        sandboxed = copy.deepcopy(layer).to(device)
        sandboxed.train()  # profile what training costs, whatever mode the caller's model is in
        yield sandboxed


def refuse_existing_gradients(module: nn.Module) -> None:
    """As FairScale: balancing a model that already holds gradients is refused (ValueError)."""
    for name, parameter in module.named_parameters():
        if parameter.grad is not None:
            raise PipeValueError(f"some parameter already has gradient ({name}); balance the model before "
                                 "training it, or clear them first with module.zero_grad(set_to_none=True)")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _detached(batch: Batch, device: torch.device):
    """A fresh leaf copy of `batch` on `device`, so each layer is measured on its own."""
    tensors = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in tensors_of(to_device(batch, device)))
    return tensors[0] if isinstance(batch, torch.Tensor) else tensors


def _backward(output: Batch) -> None:
    outputs = [t for t in tensors_of(output) if t.requires_grad]
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def profile_times(module: nn.Sequential, sample: Batch, timeout: float, device: torch.device) -> list[float]:
    """Seconds of forward + backward per layer, summed over whole passes repeated until `timeout`
    has passed (at least one timed pass, after one untimed warm-up pass of allocators and kernels)."""
    refuse_existing_gradients(module)
    times = [0.0] * len(module)
    began = time.perf_counter()
    passes = 0
    while passes < 2 or time.perf_counter() - began < timeout:
        batch = sample  # every pass starts again from the sample
        for index, layer in enumerate(layerwise_sandbox(module, device)):
            batch = _detached(batch, device)
            _synchronize(device)
            start = time.perf_counter()
            output = layer(batch)
            _backward(output)
            _synchronize(device)
            if passes > 0:
                times[index] += time.perf_counter() - start
            batch = output
        passes += 1
    return times


def profile_sizes(module: nn.Sequential, input: Batch, chunks: int, param_scale: float,
                  device: torch.device) -> list[float]:
    """Bytes per layer: saved activations of one micro-batch plus `param_scale` x parameter bytes."""
    batch = split(input, chunks)[0]
    sizes = []
    for layer in layerwise_sandbox(module, device):
        parameter_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        parameter_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameter_storages:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        batch = _detached(batch, device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            batch = layer(batch)
        sizes.append(sum(saved.values()) + param_scale * parameter_bytes)
    return sizes
