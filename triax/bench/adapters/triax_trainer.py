"""triax's own step: `Trainer.train_step` from `triax train` (GPT and Llama models), or for other models the
same core pieces the trainer composes (apply_ddp, Precision, make_adamw)."""

from __future__ import annotations

import tempfile

import torch

from triax.bench.adapters import BETAS, GRAD_CLIP, LEARNING_RATE, WEIGHT_DECAY, StepSetup, Unavailable
from triax.bench.models import loss_of
from triax.models.config import architecture_fields


def make_step(setup: StepSetup):
    if setup.model.gpt_config is not None:
        return _trainer_step(setup)
    return _core_step(setup)


def _trainer_step(setup: StepSetup):
    from triax.config import from_dict
    from triax.train.trainer import Trainer

    gpt = setup.model.gpt_config
    shape = {key: value for key, value in architecture_fields(gpt).items() if key not in ("vocab_size", "block_size")}
    config = from_dict({
        "model": {"name": setup.model.name, **shape, "dropout": 0.0},
        "data": {"block_size": gpt.block_size},
        "optim": {"lr": LEARNING_RATE, "min_lr": LEARNING_RATE, "warmup_steps": 0,
                  "betas": list(BETAS), "weight_decay": WEIGHT_DECAY},
        "trainer": {"max_steps": 10**9, "batch_size": setup.batch_size, "grad_clip": GRAD_CLIP,
                    "precision": setup.precision.name, "device": str(setup.device),
                    "run_dir": tempfile.mkdtemp(prefix="trainer-", dir=setup.scratch_dir), "eval_every": 0,
                    "log_every": 10**9, "sample_tokens": 0},
        "parallel": {"bucket_mb": setup.bucket_mb, "grad_compression": setup.grad_compression,
                     "powersgd_rank": setup.powersgd_rank},
    })
    trainer = Trainer(config)
    if trainer.model_config.vocab_size != gpt.vocab_size:
        raise Unavailable(f"trainer vocabulary {trainer.model_config.vocab_size} != bench model's "
                          f"{gpt.vocab_size}: the two would time different models")
    trainer.model.train()

    def step() -> float:
        # The trainer's step draws its batch from the corpus by global sample index (cheap
        # indexing), where the other ways reuse one synthetic batch.
        loss, _ = trainer.train_step()
        return loss

    return step


def _core_step(setup: StepSetup):
    from triax.train.optim import make_adamw
    from triax.parallel.ddp import apply_ddp

    raw = setup.model.build().to(setup.device)
    model = apply_ddp(raw, setup.device, bucket_mb=setup.bucket_mb,
                      grad_compression=setup.grad_compression, powersgd_rank=setup.powersgd_rank)
    optimizer = make_adamw(raw, LEARNING_RATE, WEIGHT_DECAY, BETAS, setup.device)
    scaler = setup.precision.make_scaler(setup.device)
    inputs, targets = setup.batch()

    def step() -> torch.Tensor:
        with setup.precision.autocast(setup.device):
            output = model(inputs)
        loss = loss_of(output, targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step
