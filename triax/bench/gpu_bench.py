"""The GPU suite's measurements: the trainer's throughput and MFU beside a minimal hand-written loop
of the same model, the largest micro-batch that fits against `triax plan`'s estimate, and what a
snapshot costs, written synchronously and in the background.

Every figure is taken on the machine that runs it. On a GPU the shapes are the real ones (GPT-2
124M and a Llama of about 125M, 1024 tokens, bf16, compiled blocks, fused AdamW, SDPA's flash
kernel); without one the same code runs a tiny shape, so the path and the report are checked
everywhere while the figures mean something only on a GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from triax.tracking.throughput import table_peak_flops
from triax.models import GPTConfig, build_model
from triax.models.config import preset_fields
from triax.parallel.mesh import GPU_VOCAB_MULTIPLE, Layout, padded_vocab_size
from triax.parallel.plan import ModelShape, estimate
from triax.config import compose_config
from triax.objectives.tokens.loss import loss_function
from triax.train.trainer import Trainer


@dataclass(frozen=True)
class BenchShape:
    """A model to time: a preset and the keys that change it, its context and its vocabulary."""

    name: str
    preset: str
    block_size: int
    vocab_size: int
    model: dict = field(default_factory=dict)

    def overrides(self) -> list[str]:
        return [f"model={self.preset}", *(f"model.{key}={value}" for key, value in self.model.items())]


# GPT-2 small as nanoGPT and llm.c train it (GPT-2's tokenizer, 1024 tokens); a Llama scaled to about
# the same size (llama-debug's proportions: grouped-query attention, SwiGLU, a 32k vocabulary).
GPT2_124M = BenchShape("gpt2-124m", "gpt2", 1024, 50257, {"tie_embeddings": "true"})
LLAMA_125M = BenchShape("llama-125m", "llama-debug", 1024, 32000,
                        {"n_layer": 12, "n_head": 12, "n_kv_head": 4, "n_embd": 768, "intermediate_size": 2048})
# Without a GPU: the same code on shapes a CPU runs in seconds.
SMOKE_GPT = BenchShape("gpt-smoke", "gpt-micro", 64, 256, {"n_layer": 2, "n_head": 2, "n_embd": 64})
SMOKE_LLAMA = BenchShape("llama-smoke", "llama-debug", 64, 256,
                         {"n_layer": 2, "n_head": 2, "n_kv_head": 1, "n_embd": 64, "intermediate_size": 160})

LEARNING_RATE = 6e-4
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_token_files(directory: str, vocab_size: int, tokens: int, seed: int = 0) -> str:
    """train.bin / val.bin of uniformly random ids with their meta.json: throughput does not depend
    on what the tokens say, and nothing is downloaded."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, count in (("train.bin", tokens), ("val.bin", max(tokens // 16, 4096))):
        rng.integers(0, vocab_size, size=count, dtype=np.uint16).tofile(os.path.join(directory, split))
    with open(os.path.join(directory, "meta.json"), "w") as handle:
        json.dump({"vocab_size": vocab_size, "dtype": "uint16"}, handle)
    return directory


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The data-sheet peak MFU is reported against (triax.tracking.throughput' table), None off a known GPU."""
    return table_peak_flops(device, dtype) if device.type == "cuda" else None


def model_config(shape: BenchShape, device: torch.device | None = None):
    """The GPTConfig `triax train` builds for this shape on `device` (the preset, its changed keys,
    no dropout, the vocabulary padded as the trainer pads it there)."""
    changed = {key: {"true": True, "false": False}.get(value, value) for key, value in shape.model.items()}
    fields = {**preset_fields(shape.preset), **changed, "dropout": 0.0}
    padded = padded_vocab_size(shape.vocab_size, 1, GPU_VOCAB_MULTIPLE if device is not None and device.type == "cuda" else 1)
    return GPTConfig(vocab_size=shape.vocab_size, block_size=shape.block_size, **fields,
                     padded_vocab_size=padded if padded != shape.vocab_size else None)


# ---- the trainer ----------------------------------------------------------------------------


def make_trainer(shape: BenchShape, batch_size: int, device: torch.device, data_dir: str, run_dir: str,
                 steps: int, log_every: int, compile_blocks: bool, extra: tuple[str, ...] = ()):
    overrides = [*shape.overrides(), "model.dropout=0.0", "data.task=tokens", f"data.path={data_dir}",
                 f"data.block_size={shape.block_size}", f"trainer.batch_size={batch_size}",
                 "trainer.precision=bf16", f"trainer.device={device}", f"trainer.max_steps={steps}",
                 f"trainer.log_every={log_every}", "trainer.eval_every=0", "trainer.sample_tokens=0",
                 "trainer.save_every=0", "trainer.loggers=[jsonl]", f"trainer.run_dir={run_dir}",
                 f"optim.lr={LEARNING_RATE}", "optim.warmup_steps=0", f"trainer.grad_clip={GRAD_CLIP}",
                 f"parallel.compile={str(compile_blocks).lower()}", *extra]
    return Trainer(compose_config(overrides))


def trainer_figures(shape: BenchShape, batch_size: int, device: torch.device, data_dir: str, run_dir: str,
                    windows: int = 4, window: int = 10, compile_blocks: bool = True):
    """`triax train`'s own figures: tokens/s and MFU from the records it logs every `window` steps;
    the first window holds the compilation and is left out, the median of the others is the
    figure. Returns (figures, the trainer, for the snapshot measurements)."""
    trainer = make_trainer(shape, batch_size, device, data_dir, run_dir, windows * window, window, compile_blocks)
    # The trainer's console lines go to its run directory, beside the metrics they repeat.
    with open(os.path.join(run_dir, "console.log"), "w") as log, contextlib.redirect_stdout(log):
        trainer.fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    steady = [record for record in records if "tokens_per_s" in record][1:]
    tokens_per_s = statistics.median(record["tokens_per_s"] for record in steady)
    mfus = [record["mfu"] for record in steady if "mfu" in record]
    figures = {"tokens_per_s": round(tokens_per_s, 1), "windows": [record["tokens_per_s"] for record in steady],
               "mfu": round(statistics.median(mfus), 4) if mfus else None,
               "peak_mem_gb": round(max(record.get("peak_mem_mb", 0.0) for record in steady) / 1024, 2),
               "params": trainer.num_params, "flops_per_token": trainer.flops_per_token}
    return figures, trainer


# ---- the hand-written loop ----------------------------------------------------------------------


class HandwrittenLoop:
    """What a PyTorch user writes by hand for the same model (nanoGPT's train.py, reduced): the
    model on the device, each block and the loss compiled as the trainer compiles them (so both
    time the same kernels), fused AdamW, bf16 autocast, batches from a memory-mapped token file
    through pinned memory, the loss read only when the timing ends."""

    def __init__(self, shape: BenchShape, batch_size: int, device: torch.device, data_dir: str,
                 compile_blocks: bool = True, seed: int = 0):
        self.config = model_config(shape, device)
        torch.manual_seed(seed)
        self.model = build_model(self.config).to(device)
        if compile_blocks:
            for block in self.model.layers.values():
                block.compile()
        self.loss = loss_function(compile_blocks)  # compiled with the blocks, as nanoGPT's whole model is
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, betas=BETAS,
                                           weight_decay=WEIGHT_DECAY, fused=device.type in ("cuda", "cpu"))
        self.tokens = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
        self.batch_size, self.block_size, self.device = batch_size, shape.block_size, device
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.block_size - 1, (self.batch_size,), generator=self.generator)
        rows = np.stack([self.tokens[s: s + self.block_size + 1] for s in starts.tolist()]).astype(np.int64)
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def step(self) -> torch.Tensor:
        x, y = self.batch()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(x)
        loss = self.loss(logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def tokens_per_s(self, steps: int, warmup: int) -> float:
        for _ in range(warmup):
            self.step()
        synchronize(self.device)
        started = time.perf_counter()
        for _ in range(steps):
            loss = self.step()
        float(loss)  # waits for the last step
        return steps * self.batch_size * self.block_size / (time.perf_counter() - started)


def handwritten_figures(shape: BenchShape, batch_size: int, device: torch.device, data_dir: str,
                        steps: int, warmup: int, rounds: int = 2, compile_blocks: bool = True) -> dict:
    loop = HandwrittenLoop(shape, batch_size, device, data_dir, compile_blocks)
    runs = [loop.tokens_per_s(steps, warmup if index == 0 else 2) for index in range(rounds)]
    tokens_per_s = statistics.median(runs)
    flops_per_token = loop.model.flops_per_token(shape.block_size)
    peak = peak_flops(device, torch.bfloat16)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del loop
    return {"tokens_per_s": round(tokens_per_s, 1), "rounds": [round(value, 1) for value in runs],
            "mfu": round(flops_per_token * tokens_per_s / peak, 4) if peak else None,
            "peak_mem_gb": round(peak_mem, 2) if peak_mem is not None else None}


# ---- the largest micro-batch ---------------------------------------------------------------------


def _step_peak_bytes(loop: HandwrittenLoop, batch_size: int) -> int:
    loop.batch_size = batch_size
    torch.cuda.reset_peak_memory_stats(loop.device)
    for _ in range(2):  # the second step holds AdamW's moments too
        loop.step()
    torch.cuda.synchronize(loop.device)
    return torch.cuda.max_memory_allocated(loop.device)


def largest_batch(shape: BenchShape, device: torch.device, data_dir: str, cap: int) -> dict:
    """The largest micro-batch (a power of two, at most `cap`) whose eager bf16 step fits in 92% of
    the GPU's memory, measured: the peak at two sizes gives memory per sample, the prediction is
    tried, and halved while it does not fit. Beside it, the largest `triax plan` predicts for the
    same memory. Eager, since every new batch size would recompile a compiled model; a compiled step
    takes less memory, so the figure is safe for it."""
    total = torch.cuda.get_device_properties(device).total_memory
    usable = 0.92 * total
    loop = HandwrittenLoop(shape, 1, device, data_dir, compile_blocks=False)
    small, large = 2, 4
    low, high = _step_peak_bytes(loop, small), _step_peak_bytes(loop, large)
    per_sample = max((high - low) / (large - small), 1.0)
    fixed = low - per_sample * small
    predicted = int((usable - fixed) // per_sample)
    batch = min(cap, 2 ** int(math.log2(max(predicted, 1))))
    while batch >= 1:
        try:
            peak = _step_peak_bytes(loop, batch)
            break
        except torch.OutOfMemoryError:
            loop.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            batch //= 2
    del loop
    torch.cuda.empty_cache()
    model_shape = ModelShape.from_config(model_config(shape, device))
    gib = 2 ** 30
    planned = 0
    while planned < 4 * cap and estimate(model_shape, Layout(), batch_size=planned + 1,
                                         precision="bf16").total_gb <= usable / gib:
        planned += 1
    return {"batch_size": batch, "peak_mem_gb": round(peak / gib, 2), "memory_gb": round(total / gib, 1),
            "per_sample_gb": round(per_sample / gib, 3), "fixed_gb": round(fixed / gib, 2),
            "predicted_max": predicted, "plan_max": planned, "cap": cap,
            "plan_over_measured": round(planned / max(predicted, 1), 3)}


# ---- snapshots -----------------------------------------------------------------------------------


def timed_steps(trainer: Trainer, steps: int) -> float:
    """Seconds per step of `steps` trainer steps, the device waited for at both ends."""
    synchronize(trainer.device)
    started = time.perf_counter()
    for _ in range(steps):
        loss, _ = trainer.steps.run()
    float(loss)
    return (time.perf_counter() - started) / steps


def snapshot_figures(trainer: Trainer, steps: int = 3) -> dict:
    """What a snapshot of this trainer's model and AdamW state costs: the synchronous write (the
    loop waits for all of it), and the background write (the loop waits for the copy to host
    memory; the steps while it is written, against steps without one)."""
    figures = {}
    baseline = timed_steps(trainer, steps)
    for asynchronous in (False, True):
        trainer.async_save = asynchronous
        trainer.steps.run()
        synchronize(trainer.device)
        started = time.perf_counter()
        trainer.save()
        pause = time.perf_counter() - started
        during = timed_steps(trainer, steps) if asynchronous else None
        trainer.finish_pending_save()
        total = time.perf_counter() - started
        figures["async" if asynchronous else "sync"] = {
            "loop_pause_s": round(pause, 3), "write_s": round(total, 3),
            **({"step_s_while_writing": round(during, 4)} if during is not None else {})}
    figures["step_s"] = round(baseline, 4)
    figures["snapshot_gb"] = round(_snapshot_bytes(trainer.last_snapshot) / 2**30, 3)
    return figures


def _snapshot_bytes(path: str | None) -> int:
    total = 0
    for root, _, files in os.walk(path or ""):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return total


@contextlib.contextmanager
def flash_attention_only(device: torch.device):
    """SDPA's flash kernel alone on a GPU, so a fall-back to the slower kernels fails loudly
    instead of costing throughput silently; no restriction on a CPU."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield
