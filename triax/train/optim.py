"""AdamW with decoupled weight decay on matmul weights (or, if asked, on every matrix or every
parameter), and a warm-up + decay schedule: triax's own cosine, or nanoGPT's or transformers' (to
continue a run one of them began)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from triax.config.schema import DECAY_RULES




def split_decay_parameters(model: nn.Module, rule: str = "linear"):
    """(decayed, not decayed) trainable parameters.

    linear: weight decay shrinks the weights of Linear layers only; biases, LayerNorm gains and
    embedding tables are left alone. The rule goes by module type, not by parameter names, so it
    survives renaming and wrappers (DDP, FSDP, compiled modules). A weight shared between an
    Embedding and a Linear (tied embeddings) is a Linear weight and is decayed, once. A module that
    is a matmul weight without being a Linear says so (`matmul_weight = True`: LoRA's adapter factors).
    matrices: every parameter of two or more dimensions (the embedding tables too).
    all: every parameter.
    """
    if rule not in DECAY_RULES:
        raise ValueError(f"weight decay rule {rule!r} is not one of {', '.join(DECAY_RULES)}")
    linear_weights = {id(module.weight) for module in model.modules()
                      if isinstance(module, nn.Linear) or getattr(module, "matmul_weight", False)}
    decayed, not_decayed, seen = [], [], set()
    for parameter in model.parameters():
        if not parameter.requires_grad or id(parameter) in seen:
            continue
        seen.add(id(parameter))
        decays = (id(parameter) in linear_weights if rule == "linear"
                  else parameter.dim() >= 2 if rule == "matrices" else True)
        (decayed if decays else not_decayed).append(parameter)
    return decayed, not_decayed


# Devices with a fused AdamW kernel in torch (CPU since 2.4).
FUSED_DEVICES = ("cuda", "cpu")


def make_adamw(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95),
               device: torch.device | None = None, decay: str = "linear",
               fused: bool | None = None, eps: float = 1e-8) -> torch.optim.AdamW:
    decayed, not_decayed = split_decay_parameters(model, decay)
    groups = [{"params": decayed, "weight_decay": weight_decay},
              {"params": not_decayed, "weight_decay": 0.0}]
    # No empty group (LoRA trains matmul weights only): a snapshot's optimizer state does not
    # restore into one (torch.distributed.checkpoint's state dict drops its hyper-parameters).
    groups = [group for group in groups if group["params"]]
    # The fused kernel updates every parameter in one call, on CUDA and on CPUs alike. torch's
    # default elsewhere is a per-parameter Python loop: on a 0.8M-parameter GPT on one CPU thread
    # that took 2.5 ms a step against 0.55 ms fused (benchmarks/vs_nanogpt.py's model).
    if fused is None:
        fused = device is not None and device.type in FUSED_DEVICES
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


def warmup_cosine(step: int, max_steps: int, warmup_steps: int, lr: float, min_lr: float,
                  schedule: str = "cosine") -> float:
    """The learning rate of step `step` (0-based, before it is taken).

    cosine: linear warm-up from lr/warmup to lr, then cosine decay to min_lr at max_steps.
    nanogpt: nanoGPT's get_lr, whose warm-up is lr * (step + 1) / (warmup + 1) (it never quite
    reaches lr), then the same cosine. linear and cosine_hf: transformers' get_linear_schedule_with_warmup
    and get_cosine_schedule_with_warmup (a Trainer's lr_scheduler_type linear, its default, and
    cosine), whose warm-up starts from 0 (lr * step / warmup), then a straight line or the same
    cosine down to min_lr (0 in transformers). constant: lr throughout (nanoGPT's decay_lr=False)."""
    if schedule == "constant":
        return lr
    if schedule in ("linear", "cosine_hf") and step < warmup_steps:
        return lr * step / warmup_steps
    if schedule == "linear":
        # transformers' own arithmetic, (max - step) / (max - warmup), so the rates are its to the bit
        return min_lr + (lr - min_lr) * max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + (schedule == "nanogpt"))
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def make_schedule(optimizer: torch.optim.Optimizer, max_steps: int, warmup_steps: int,
                  min_lr: float, schedule: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (so it saves and loads like any scheduler) following `warmup_cosine`."""
    base_lr = optimizer.param_groups[0]["lr"]

    def factor(step: int) -> float:
        return warmup_cosine(step, max_steps, warmup_steps, base_lr, min_lr, schedule) / base_lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def move_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put a fresh schedule at `step` (a run continued from another tool's checkpoint): the next
    optimizer step uses that step's learning rate, as if the schedule had been stepped `step` times."""
    scheduler.last_epoch = step
    rates = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() reports, as step() would have set it
