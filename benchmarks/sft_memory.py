"""The token loss's peak memory with the whole logits and with the logits in chunks: one SFT step at
Qwen's 151,936-word vocabulary and 1,024 tokens (docs/performance.md, parallel.max_logits_mb).

The model is a tiny random Llama (2 layers, width 64) whose embedding and output layer have 151,936
rows, so that the `[rows x 1,024 x 151,936]` logits dominate. Each side runs one step in a fresh
process of its own: the trainer's token loss (triax.objectives.tokens) on `--rows` rows of 1,024
tokens, a quarter of each row's targets ignored (a chat prompt), the forward under the step's own
`forward`, the backward, and an AdamW update of every weight, fp32. `whole` sets
parallel.max_logits_mb=0 (the logits at once); `chunked` leaves the default (256 MB: 441
positions at a time). The figure is the process's peak resident memory (`VmHWM`, as
`resource.getrusage` reports it) and its growth over the resident memory just before the step; the
two losses are printed too (they agree to fp32 round-off), and the step's seconds (the chunks
recompute the output layer's matmul in the backward: on a shared machine, a rough figure).

    python benchmarks/sft_memory.py            # 4 rows of 1,024 tokens
    python benchmarks/sft_memory.py --rows 1   # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCABULARY, LENGTH = 151_936, 1024

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_memory import MEMORY  # noqa: E402  (resident_mib, peak_mib: how both benchmarks measure)

STEP_SCRIPT = MEMORY + r"""
import contextlib, json, sys, time
import torch
from triax.data.targets import IGNORE_INDEX
from triax.models import build_model
from triax.models.config import GPTConfig
from triax.objectives import StepContext
from triax.objectives.tokens.loss import token_cross_entropy
from triax.objectives.tokens.objective import TokenLoss
from triax.train.step import TrainingStep

max_logits_mb, rows, length, vocabulary = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
config = GPTConfig(arch="llama", vocab_size=vocabulary, block_size=length, n_layer=2, n_head=4, n_kv_head=2,
                   n_embd=64, intermediate_size=176)
torch.manual_seed(0)
model = build_model(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
generator = torch.Generator().manual_seed(1)
x = torch.randint(0, vocabulary, (rows, length), generator=generator)
y = torch.randint(0, vocabulary, (rows, length), generator=generator)
y[:, :length // 4] = IGNORE_INDEX
context = StepContext(torch.device("cpu"), contextlib.nullcontext, TrainingStep.forward, grad_accum=1,
                      data_parallel_size=1, data_parallel_rank=0, seed=0)
objective = TokenLoss(token_cross_entropy, mean_per_token=False, max_logits_mb=max_logits_mb)
before = resident_mib()
started = time.perf_counter()
scaled, loss = objective.loss(context, model, (x, y, None))
scaled.backward()
optimizer.step()
seconds = time.perf_counter() - started
print(json.dumps({"before_mib": before, "peak_mib": peak_mib(), "loss": float(loss), "seconds": seconds}))
"""


def step(max_logits_mb: float, rows: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", STEP_SCRIPT, str(max_logits_mb), str(rows), str(LENGTH),
                             str(VOCABULARY)], capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"the step failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    from triax.objectives.logits_budget import CPU_LOGITS_MB  # the unset limit of a CPU run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="rows of 1,024 tokens in the micro-batch")
    args = parser.parse_args()
    results = {"whole": step(0.0, args.rows), "chunked": step(CPU_LOGITS_MB, args.rows)}
    for name, figures in results.items():
        print(f"{name}: peak {figures['peak_mib']:,.0f} MiB ({figures['peak_mib'] - figures['before_mib']:,.0f} MiB "
              f"above the {figures['before_mib']:,.0f} MiB before the step), loss {figures['loss']:.6f}, "
              f"{figures['seconds']:.1f} s")
    whole, chunked = results["whole"], results["chunked"]
    print(f"one step, {args.rows} x {LENGTH} tokens x {VOCABULARY:,} words: chunked/whole peak ratio "
          f"{chunked['peak_mib'] / whole['peak_mib']:.2f}; the step's growth ratio "
          f"{(chunked['peak_mib'] - chunked['before_mib']) / (whole['peak_mib'] - whole['before_mib']):.2f}")


if __name__ == "__main__":
    main()
