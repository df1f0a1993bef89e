"""Gradient compression for allreduce: send floats as 16-bit, restore the original dtype after.

Same shape as Horovod's: a Compressor has `compress(tensor) -> (tensor, ctx)` and
`decompress(tensor, ctx) -> tensor`, so user-written compressors plug in unchanged.
"""

from __future__ import annotations

import torch


class Compressor:
    """Interface: subclasses override both static methods."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: torch.Tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype | None):
        return tensor


class _CastCompressor(Compressor):
    """Casts floating tensors to `wire_dtype`; integers and already-16-bit tensors pass as they are."""

    wire_dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        original = tensor.dtype
        if tensor.is_floating_point() and original != cls.wire_dtype:
            tensor = tensor.to(cls.wire_dtype)
        return tensor, original

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: torch.dtype | None):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    # bf16 keeps fp32's range, so large gradient sums cannot overflow as they can in fp16.
    wire_dtype = torch.bfloat16


class Compression:
    """`hvd.Compression.none`, `.fp16`, `.bf16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
