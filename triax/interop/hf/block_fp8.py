"""Weights released as 8-bit floats with one scale per block (DeepSeek-V3's, and transformers'
"fp8" quantization_config with weight_block_size): a Linear's `weight` stored as float8_e4m3fn
beside `weight_scale_inv`, a float32 grid of one value per block of rows x columns (128 x 128 as
released; the last block of a dimension that is not a multiple is partial, the grid rounded up).
The value is weight[i, j] * weight_scale_inv[i // rows, j // columns]. `BlockScaled` serves such
tensors dequantized to float32, reading only the slice asked for and its blocks' scales, so every
process dequantizes only its own shard."""

from __future__ import annotations

import math

import torch

from triax.interop.hf.files import CheckpointError, HFWeights
from triax.interop.hf.safetensors_header import FLOAT_DTYPES, TensorEntry

QUANTIZED_DTYPES = ("F8_E4M3",)
SCALE_SUFFIX = "_scale_inv"


def block_size(config: dict) -> tuple[int, int] | None:
    """(rows, columns) of a block, from config.json's quantization_config; None: not fp8 block-scaled
    (another quantization is its family's adapter's to read, as gpt_oss's MXFP4 experts, or to refuse)."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 2**16 for v in block)):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size={block!r} is not two positive "
                              "integers (rows and columns of a block)")
    return block[0], block[1]


class BlockScaled:
    """A checkpoint's tensors (HFWeights) with each block-scaled weight served as float32 values."""

    def __init__(self, weights: HFWeights, block: tuple[int, int]):
        self.weights, self.block = weights, block

    def __getattr__(self, name: str):
        return getattr(self.weights, name)  # prefix, directory...

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def _scale_of(self, name: str) -> str | None:
        """The name of `name`'s scales, if it is stored quantized (checked against its shape)."""
        entry = self.weights.entry(name)
        if entry.dtype not in QUANTIZED_DTYPES:
            return None
        scale = name + SCALE_SUFFIX
        if not self.weights.has(scale):
            raise CheckpointError(f"the checkpoint's {name} is stored as {entry.dtype} without its {scale}; an 8-bit "
                                  "weight is read with its scales")
        grid = tuple(math.ceil(size / block) for size, block in zip(entry.shape, self.block))
        stored = self.weights.entry(scale)
        if len(entry.shape) != 2 or stored.shape != grid or stored.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"the checkpoint's {scale} is {stored.dtype} {list(stored.shape)}; the {entry.dtype} "
                                  f"weight {list(entry.shape)} in blocks of {list(self.block)} needs a floating grid "
                                  f"{list(grid)}")
        return scale

    def entry(self, name: str) -> TensorEntry:
        entry = self.weights.entry(name)
        return TensorEntry("F32", entry.shape) if self._scale_of(name) else entry

    def shape(self, name: str) -> tuple[int, ...]:
        return self.weights.shape(name)

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        scale = self._scale_of(name)
        if scale is None:
            return self.weights.slice(name, index)
        rows, columns = (range(*part.indices(size)) for part, size in zip(index, self.weights.shape(name)))
        values = self.weights.slice(name, index).float()
        if not len(rows) or not len(columns):
            return values
        (block_rows, block_columns), first_row, first_column = self.block, rows.start, columns.start
        grid = self.weights.slice(scale, (slice(first_row // block_rows, (rows.stop - 1) // block_rows + 1),
                                          slice(first_column // block_columns, (columns.stop - 1) // block_columns + 1)))
        row_block = torch.arange(first_row, rows.stop) // block_rows - first_row // block_rows
        column_block = torch.arange(first_column, columns.stop) // block_columns - first_column // block_columns
        return values * grid.float()[row_block][:, column_block]
