"""A portal carries one stashed tensor from the partition that stashes it to the one that pops it.

Inside a `Pipe` the tensor must not ride on autograd's graph between the two partitions: a
checkpointed partition keeps only its own inputs, so a tensor reaching it from the side would be
rebuilt without a gradient path, and it would be kept alive by the graph long after it is used.
Instead the portal holds the tensor out of sight, and three autograd nodes stand in for it:

    stash partition                        pop partition
    tensor -> PortalBlue -> phony          phony -> PortalCopy -> phony     phony -> PortalOrange -> tensor
                             |                        |                                  |
    main lane ------------ join ----- ... -- fork ---+--- join ---------- ... -- fork --+--- layers

PortalOrange hands the tensor to the popping layer; in backward it leaves the tensor's gradient in
the portal. PortalCopy moves the tensor to the pop partition's device (in backward, the gradient
back). PortalBlue's backward returns that gradient to whatever produced the tensor. The phonies,
forked off and joined into the micro-batch's main lane (dependency.py), make autograd run them in
exactly that order.

The portal keeps the tensor only for as many reads as will come (`tensor_life`), then drops it,
so memory is freed as soon as nothing can need it. Reads: PortalBlue and PortalOrange's forward
take one each; when the micro-batch is checkpointed, the pop partition's recomputation reads it
once more, and the stash partition's recomputation puts its recomputed tensor back for its own
PortalBlue (see tracker.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from triax.pipe.dependency import phony as new_phony
from triax.pipe.errors import PipeRuntimeError

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx


class Portal:
    """One stashed tensor of one micro-batch, with the number of reads it is kept for."""

    def __init__(self, tensor: torch.Tensor | None, tensor_life: int):
        self.put_tensor(tensor, tensor_life)
        self.grad: torch.Tensor | None = None

    def put_tensor(self, tensor: torch.Tensor | None, tensor_life: int) -> None:
        """Keep `tensor` for `tensor_life` reads (none: dropped at once)."""
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise PipeRuntimeError("tensor in portal has been removed: a stashed tensor was popped more times "
                                   "than the pipe schedules (pop each stashed name once per forward pass)")

    def use_tensor(self) -> torch.Tensor | None:
        """One read: the tensor, dropped from the portal when this was its last read."""
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def use_grad(self) -> torch.Tensor | None:
        """The gradient left by PortalOrange, handed over once. None when the popped tensor got no
        gradient (the popping layer did not use it differentiably): its producer gets none either."""
        grad, self.grad = self.grad, None
        return grad

    # -- the three nodes; each returns a phony to fork from or join into the main lane ----------

    def blue(self) -> torch.Tensor:
        """Take the tensor out of the graph; the returned phony is to be joined into the main lane."""
        tensor = self.use_tensor()
        if tensor is None:  # a stashed None: nothing to hand a gradient back to
            return new_phony(torch.device("cpu"))
        return PortalBlue.apply(self, tensor)

    def orange(self, phony: torch.Tensor) -> torch.Tensor | None:
        """The tensor again, for the popping layer; `phony` is forked from the main lane."""
        self.check_tensor_life()
        if self.tensor is None:
            return self.use_tensor()
        return PortalOrange.apply(self, phony)

    def copy(self, device: torch.device, phony: torch.Tensor) -> torch.Tensor:
        """Move the tensor to `device`; `phony` is forked from, and the result joined into, the main lane."""
        if self.tensor is None:
            return new_phony(torch.device("cpu"))
        return PortalCopy.apply(self, device, phony)


class PortalBlue(torch.autograd.Function):
    """Forward: hides the tensor. Backward: gives the tensor's producer the gradient PortalOrange left."""

    @staticmethod
    def forward(ctx: FunctionCtx, portal: Portal, tensor: torch.Tensor):
        ctx.portal = portal
        return new_phony(tensor.device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_phony: torch.Tensor):
        return None, ctx.portal.use_grad()


class PortalOrange(torch.autograd.Function):
    """Forward: the hidden tensor, cut from its producer's graph. Backward: leaves its gradient in the portal."""

    @staticmethod
    def forward(ctx: FunctionCtx, portal: Portal, phony: torch.Tensor):
        ctx.portal = portal
        return portal.use_tensor().detach()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        ctx.portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    """Forward: moves the hidden tensor to the pop partition's device. Backward: moves its gradient back."""

    @staticmethod
    def forward(ctx: FunctionCtx, portal: Portal, device: torch.device, phony: torch.Tensor):
        ctx.portal = portal
        ctx.source_device = portal.tensor.device
        # The copy replaces the original in the portal, so the source device's memory is freed now.
        portal.tensor = portal.tensor.detach().to(device)
        return new_phony(device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_phony: torch.Tensor):
        portal = ctx.portal
        if portal.grad is not None:
            portal.grad = portal.grad.to(ctx.source_device)
        return None, None, None
