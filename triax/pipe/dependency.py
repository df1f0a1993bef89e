"""Making autograd run one thing before another without passing data between them.

Autograd orders backward work only by data: a node runs once every node that consumed its outputs
has run. Skip connections hand a tensor and its gradient between partitions outside the graph
(see skip/portal.py), so the order must be made explicit. A *phony* is an empty tensor whose only
job is to be an edge: `fork` branches a phony off a tensor's lane, `join` ties a phony back into
one. Both pass the tensor's values and gradient through unchanged:

    x, phony = fork(x)       # whatever consumes `phony` finishes its backward before x's producer
    x = join(x, phony)       # the producer of `phony` runs its backward after x's consumers
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


def phony(device: torch.device, requires_grad: bool = False) -> torch.Tensor:
    """An empty tensor on `device`: an autograd edge that carries no values."""
    return torch.empty(0, device=device, requires_grad=requires_grad)


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, input: torch.Tensor):
        return input.detach(), phony(input.device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_input: torch.Tensor, grad_phony: torch.Tensor):
        return grad_input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, input: torch.Tensor, joined_phony: torch.Tensor):
        return input.detach()

    @staticmethod
    def backward(ctx: FunctionCtx, grad_input: torch.Tensor):
        return grad_input, None


def fork(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` unchanged, and a phony branched off its lane (a plain phony when nothing records)."""
    if torch.is_grad_enabled() and tensor.requires_grad:
        return Fork.apply(tensor)
    return tensor, phony(tensor.device)


def join(tensor: torch.Tensor, joined_phony: torch.Tensor) -> torch.Tensor:
    """`tensor` unchanged, with `joined_phony` tied into its lane (nothing to tie when nothing records)."""
    if torch.is_grad_enabled() and (tensor.requires_grad or joined_phony.requires_grad):
        return Join.apply(tensor, joined_phony)
    return tensor
