"""Parallelism applied from outside a plain model (DESIGN.md): one file per technique."""

from triax.parallel.ddp import apply_ddp

__all__ = ["apply_ddp"]
