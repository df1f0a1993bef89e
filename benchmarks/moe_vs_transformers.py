"""A training step of a small Mixtral in triax against transformers' own MixtralForCausalLM, side by side.

The model: 256 wide, 4 layers, 8 query heads on 4 key/value heads, 8 experts of SwiGLU 512, top-2,
a vocabulary of 1024; batches of 8 sequences of 128 random tokens; fp32. transformers builds it and
saves it; triax reads that checkpoint (`model.init_from`'s reader), so both start from the same
weights and compute the same loss. Each step is what a plain loop writes: logits, cross-entropy,
backward, torch.optim.AdamW (defaults), zero_grad. Runs alternate A B A B, each in a fresh process
with one thread, so load from anything else on the machine falls on both alike.

    python benchmarks/moe_vs_transformers.py                       # 3 rounds of 20 steps
    python benchmarks/moe_vs_transformers.py --rounds 1 --steps 5  # a quick look

Printed per run: the median step (wall-clock and this process's CPU time) and the first step's
loss (the same for both, up to fp32 round-off); then the ratio transformers / triax of the median
steps (above 1: triax is faster).
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

SHAPE = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128)
BLOCK, BATCH = 128, 8


def make_checkpoint(directory: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**SHAPE)).save_pretrained(directory)


def build(side: str, directory: str):
    """The model of `side` holding the checkpoint's weights, and a function from ids to the mean loss."""
    import torch
    import torch.nn.functional as F

    if side == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        logits_of = lambda ids: model(ids).logits  # noqa: E731
    else:
        from triax.interop.hf.whole_model import load_hf_model

        model = load_hf_model(directory, torch.device("cpu"))
        logits_of = model
    model.train()

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        logits = logits_of(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))

    return model, loss_of


def run(side: str, directory: str, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    model, loss_of = build(side, directory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    walls, cpus, first = [], [], None
    for _ in range(steps + 1):  # the first step warms up (allocations), not timed
        ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, BLOCK + 1), generator=generator)
        wall, cpu = time.perf_counter(), time.process_time()
        loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        first = loss.item() if first is None else first
    return {"side": side, "step_s": statistics.median(walls[1:]), "cpu_s": statistics.median(cpus[1:]),
            "first_loss": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--side", choices=("triax", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # one run, in its own process
        print(json.dumps(run(args.side, args.checkpoint, args.steps)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as directory:
        make_checkpoint(directory)
        results = {"triax": [], "transformers": []}
        for _ in range(args.rounds):
            for side in ("transformers", "triax"):
                out = subprocess.run([sys.executable, __file__, "--side", side, "--checkpoint", directory,
                                      "--steps", str(args.steps)], env=env, capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                results[side].append(result)
                print(f"{side:>12}: median step {result['step_s'] * 1e3:7.1f} ms wall, {result['cpu_s'] * 1e3:7.1f} ms "
                      f"CPU; first loss {result['first_loss']:.6f}", flush=True)
    median = {side: statistics.median(r["step_s"] for r in runs) for side, runs in results.items()}
    print(f"transformers / triax, median step: {median['transformers'] / median['triax']:.2f}x "
          "(above 1: triax is faster)")


if __name__ == "__main__":
    main()
