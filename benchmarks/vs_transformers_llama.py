"""triax's trainer against a plain training loop over transformers' LlamaForCausalLM, side by side.

The same tiny Llama (the llama-debug preset: 4 layers, 4 query heads on 2 key/value heads, width
128, SwiGLU of 352, rotary positions) starts from the same weights (triax's initialisation, given
to transformers through `--format hf`'s tensor mapping), reads the same batches (triax's character
data of the built-in corpus, in triax's sample order), and takes the same steps: AdamW (0.9, 0.95)
with weight decay 0.1 on matmul weights, warm-up and cosine decay, gradient clipping at 1.0, fp32,
one thread each. The transformers loop is what a user writes: model(ids).logits, cross-entropy,
backward, clip, torch.optim.AdamW with its defaults, a LambdaLR. Runs alternate A B A B, each in a
fresh process, so load from anything else on the machine falls on both alike.

    python benchmarks/vs_transformers_llama.py                       # 3 rounds of 200 steps
    python benchmarks/vs_transformers_llama.py --rounds 1 --steps 30 # a quick look

Printed per run: the median step (wall-clock, and this process's CPU time, which other jobs on a
busy machine disturb less), the training loop's wall-clock, and the last training loss (the two
follow the same trajectory up to fp32 round-off); then the ratios transformers / triax (above 1:
triax is faster). --fused-adamw gives the transformers loop the fused AdamW
kernel triax uses, to see how much of the difference is the optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PRESET = "llama-debug"
BLOCK_SIZE = 64
BATCH_SIZE = 12
LR, MIN_LR, WARMUP, BETAS, WEIGHT_DECAY, CLIP = 1e-3, 1e-4, 20, (0.9, 0.95), 0.1, 1.0
SEED = 1337


def config_overrides(run_dir: str, steps: int) -> list[str]:
    return [f"model={PRESET}", f"data.block_size={BLOCK_SIZE}", f"trainer.batch_size={BATCH_SIZE}",
            f"trainer.max_steps={steps}", f"optim.lr={LR}", f"optim.min_lr={MIN_LR}", f"optim.warmup_steps={WARMUP}",
            f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.weight_decay={WEIGHT_DECAY}", f"trainer.grad_clip={CLIP}",
            f"trainer.seed={SEED}", "trainer.eval_every=0", f"trainer.log_every={10**9}", "trainer.sample_tokens=0",
            f"trainer.run_dir={run_dir}", "trainer.precision=fp32", "trainer.device=cpu", "trainer.loggers=[jsonl]"]


def timed_steps(step, steps: int) -> tuple[dict, float]:
    """{"step_times": wall seconds per step, "cpu_times": this process's CPU seconds per step}, last loss."""
    times, cpu_times, loss = [], [], float("nan")
    for _ in range(steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = step()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    return {"step_times": times, "cpu_times": cpu_times}, loss


def run_triax(steps: int) -> dict:
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(compose_config(config_overrides(run_dir, steps)))
        trainer.model.train()
        started = time.perf_counter()
        times, loss = timed_steps(lambda: trainer.train_step()[0], steps)
        wall = time.perf_counter() - started
        trainer.logger.close()
    return {**times, "wall_s": wall, "last_loss": loss}


def run_transformers(steps: int, fused_adamw: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from triax.data import GlobalSampler
    from triax.models import build_model
    from triax.models.llama import hf as hf_llama
    from triax.train.optim import split_decay_parameters, warmup_cosine
    from triax.config import compose_config, gpt_config
    from triax.train.data import build_data

    with tempfile.TemporaryDirectory() as run_dir:
        config = compose_config(config_overrides(run_dir, steps))
    data = build_data(config.data)
    triax_config = gpt_config(config.model, data.vocab_size, data.block_size)
    # The same initial weights as the trainer's (a function of the seed), under transformers' names.
    reference = build_model(triax_config, seed=SEED)
    model = LlamaForCausalLM(LlamaConfig(**hf_llama.hf_config(triax_config)))
    weights = {name: build() for name, build, _ in hf_llama.hf_tensors(triax_config, reference.state_dict())}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    del reference
    model.train()
    decayed, not_decayed = split_decay_parameters(model)
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": WEIGHT_DECAY},
                                   {"params": not_decayed, "weight_decay": 0.0}], lr=LR, betas=BETAS,
                                  fused=True if fused_adamw else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, steps, WARMUP, LR, MIN_LR) / LR)
    sampler = GlobalSampler(len(data.train), seed=SEED)
    position = {"epoch": 0, "index": 0}

    def step() -> float:
        if not sampler.fits(position["index"], BATCH_SIZE):
            position["epoch"], position["index"] = position["epoch"] + 1, 0
        x, y = data.train.batch(sampler.rank_slice(position["epoch"], position["index"], BATCH_SIZE, 0))
        position["index"] += BATCH_SIZE
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss.item()

    started = time.perf_counter()
    times, loss = timed_steps(step, steps)
    return {**times, "wall_s": time.perf_counter() - started, "last_loss": loss}


def worker(which: str, steps: int, fused_adamw: bool) -> None:
    import torch

    torch.set_num_threads(1)
    result = run_triax(steps) if which == "triax" else run_transformers(steps, fused_adamw)
    print("RESULT " + json.dumps(result), flush=True)


def run_worker(which: str, steps: int, fused_adamw: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), "--worker", which, "--steps", str(steps)]
    if fused_adamw:
        command.append("--fused-adamw")
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the {which} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="A B rounds (each run a fresh process)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--fused-adamw", action="store_true", help="the transformers loop uses fused AdamW too")
    parser.add_argument("--worker", choices=("triax", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.steps, args.fused_adamw)
    import torch
    import transformers

    print(f"{PRESET}, block {BLOCK_SIZE}, batch {BATCH_SIZE}, fp32, 1 thread each; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; {args.rounds} rounds of {args.steps} steps, alternated", flush=True)
    runs = {"triax": [], "transformers": []}
    for round_number in range(args.rounds):
        for which in ("triax", "transformers") if round_number % 2 == 0 else ("transformers", "triax"):
            result = run_worker(which, args.steps, args.fused_adamw)
            # The first steps warm the allocator and caches: the median of the rest is the step.
            skip = min(5, args.steps - 1)
            result["median_step_s"] = statistics.median(result["step_times"][skip:])
            result["median_cpu_s"] = statistics.median(result["cpu_times"][skip:])
            runs[which].append(result)
            print(f"round {round_number + 1} {which:>12}: median step {1000 * result['median_step_s']:.2f} ms "
                  f"({1000 * result['median_cpu_s']:.2f} ms CPU), loop {result['wall_s']:.2f} s, "
                  f"last loss {result['last_loss']:.4f}", flush=True)
    summary = {key: {which: statistics.median(r[key] for r in results) for which, results in runs.items()}
               for key in ("median_step_s", "median_cpu_s", "wall_s")}
    step, cpu, wall = summary["median_step_s"], summary["median_cpu_s"], summary["wall_s"]
    print(f"median step: triax {1000 * step['triax']:.2f} ms, transformers {1000 * step['transformers']:.2f} ms; "
          f"ratio transformers / triax {step['transformers'] / step['triax']:.3f} (CPU time per step "
          f"{cpu['transformers'] / cpu['triax']:.3f}, loop wall-clock {wall['transformers'] / wall['triax']:.3f})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"runs": runs, **summary}, handle, indent=1)


if __name__ == "__main__":
    main()
