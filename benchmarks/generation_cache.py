"""Token-by-token generation with and without the key/value cache (GPT.generate's use_cache).

For each model size below, generates the same tokens from a 16-token prompt with the cache off and
on, in turn (off, on, off, on, ...), and prints the best time of each and the ratio. The models are
freshly initialised (the text is noise; the arithmetic is that of a trained model). The cache
helps while the text fits the context window: the nanoGPT benchmark's 64-token window slides
after 48 new tokens, so most of its 200 tokens are recomputed either way.

    python benchmarks/generation_cache.py               # one thread, as the nanoGPT benchmark
    python benchmarks/generation_cache.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from triax.models import GPT, GPTConfig  # noqa: E402

# name: (n_layer, n_head, n_embd, block_size, vocab_size, new tokens)
MODELS = {
    "nanoGPT benchmark (4 x 128, block 64)": (4, 4, 128, 64, 65, 200),
    "gpt-mini (6 x 192, block 256)": (6, 6, 192, 256, 65, 200),
    "gpt2 (124M, block 1024)": (12, 12, 768, 1024, 50257, 100),
}


def seconds(model: GPT, prompt: torch.Tensor, tokens: int, use_cache: bool) -> float:
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    model.generate(prompt, tokens, temperature=0.8, top_k=20, generator=generator, use_cache=use_cache)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs per model; the best of each counts")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), best of {args.rounds}")
    for name, (n_layer, n_head, n_embd, block_size, vocab_size, tokens) in MODELS.items():
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                              n_embd=n_embd, tie_embeddings=True), seed=0).eval()
        prompt = torch.randint(0, vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for use_cache in (False, True):
                times[use_cache].append(seconds(model, prompt, tokens, use_cache))
        off, on = min(times[False]), min(times[True])
        print(f"{name}: {tokens} tokens | without cache {off:6.2f} s | with {on:6.2f} s | {off / on:4.1f}x", flush=True)


if __name__ == "__main__":
    main()
