"""What documents that never see each other (data.packing with token data) cost: one training
step's forward and backward on packed windows, without and with the document mask, in turn.

Without the mask attention is SDPA's causal kernel (is_causal); with it, SDPA takes an explicit
(batch, 1, T, T) boolean mask built from each position's document number, and the positions
restart at each document. Documents of random lengths (mean `--document` tokens) fill the
windows. Prints the best time of each and the ratio.

    python benchmarks/document_masking.py                     # gpt-mini's shape, block 256, 1 thread
    python benchmarks/document_masking.py --block 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from triax.models import GPTConfig, build_model  # noqa: E402


def document_numbers(batch: int, block: int, mean_length: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, block) document numbers: a new document after each position with probability 1/mean."""
    starts = torch.rand(batch, block, generator=generator) < 1.0 / mean_length
    return starts.long().cumsum(dim=1)


def step_seconds(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None) -> float:
    started = time.perf_counter()
    logits = model(x, documents=documents) if documents is not None else model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--document", type=int, default=64, help="mean document length in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arch", default="llama", choices=("llama", "gpt2"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = GPTConfig(n_layer=6, n_head=6, n_embd=192, block_size=args.block, vocab_size=65, dropout=0.0,
                       arch=args.arch)
    model = build_model(config)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 65, (args.batch, args.block), generator=generator)
    y = torch.randint(0, 65, (args.batch, args.block), generator=generator)
    documents = document_numbers(args.batch, args.block, args.document, generator)
    step_seconds(model, x, y, None), step_seconds(model, x, y, documents)  # warm-up
    plain, masked = [], []
    for _ in range(args.rounds):  # in turn, so a machine that slows down slows both
        plain.append(step_seconds(model, x, y, None))
        masked.append(step_seconds(model, x, y, documents))
    print(f"{args.arch} 6 x 192, block {args.block}, batch {args.batch}, documents of ~{args.document} tokens, "
          f"{args.threads} thread(s): causal {min(plain) * 1e3:.1f} ms, document mask {min(masked) * 1e3:.1f} ms, "
          f"ratio {min(masked) / min(plain):.2f}x (best of {args.rounds})")


if __name__ == "__main__":
    main()
