"""Precision policies shared by every door.

One object answers the three questions a training step asks: which dtype does autocast compute in,
does the loss need scaling (fp16's narrow exponent), and which dtype do parameters live in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from triax.errors import ConfigError

POLICY_NAMES = ("fp32", "bf16", "fp16", "bf16-pure")


@dataclass(frozen=True)
class Precision:
    """name: fp32 | bf16 (autocast, fp32 master weights) | fp16 (autocast + loss scaling, CUDA)
    | bf16-pure (parameters themselves in bf16; no autocast)."""

    name: str = "fp32"

    def __post_init__(self):
        if self.name not in POLICY_NAMES:
            raise ConfigError(f"unknown precision {self.name!r}; choose one of {', '.join(POLICY_NAMES)}")

    @property
    def compute_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "bf16-pure": torch.bfloat16}[self.name]

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16-pure" else torch.float32

    @property
    def uses_autocast(self) -> bool:
        return self.name in ("bf16", "fp16")

    @property
    def needs_loss_scaling(self) -> bool:
        return self.name == "fp16"

    def check_device(self, device: torch.device) -> None:
        """Refuse a policy the device cannot run, before any work starts."""
        if self.name == "fp16" and device.type != "cuda":
            raise ConfigError(f"precision fp16 needs a CUDA device (this run uses {device.type}); "
                              "use precision=bf16 on CPU")
        if self.name in ("bf16", "bf16-pure") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"precision {self.name} is not supported by {torch.cuda.get_device_name(device)}; "
                              "use precision=fp16")

    def autocast(self, device: torch.device):
        """The forward-pass context: autocast for the mixed policies, nothing otherwise."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def make_scaler(self, device: torch.device) -> "torch.amp.GradScaler":
        """A GradScaler that is active only for fp16; for the others it is a pass-through, so
        callers never branch on the policy."""
        return torch.amp.GradScaler(device.type, enabled=self.needs_loss_scaling)
