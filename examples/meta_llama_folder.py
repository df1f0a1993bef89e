"""Write a tiny random Llama in the layout of Meta's download (params.json and consolidated.00.pth,
Meta's names and rotary order), with token files for it: a stand-in for a Llama folder to try the
Meta commands of docs/switching.md with, on a CPU, with nothing downloaded.

    python examples/meta_llama_folder.py path/to/Llama-debug --tokens llama_tokens

The model has 2 layers, 32 wide, 4 query heads over 2 key/value heads and 512 tokens; the token
files (train.bin, val.bin: uint16 ids below 512) stand for text tokenized with its tokenizer, which
triax does not read (tokenizer.model). examples/torchtitan_checkpoint.py writes the same model as
torchtitan's checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

PARAMS = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "multiple_of": 32,
          "norm_eps": 1e-5, "rope_theta": 500000.0}
FFN_DIM = 96  # what Meta's code computes from dim and multiple_of: 2/3 x 4 x 32, rounded up to 32


def meta_state() -> dict[str, torch.Tensor]:
    """The model's tensors under Meta's names, random (seeded) at a small scale."""
    dim, vocab = PARAMS["dim"], PARAMS["vocab_size"]
    kv_dim = dim // PARAMS["n_heads"] * PARAMS["n_kv_heads"]
    shapes = {"tok_embeddings.weight": (vocab, dim), "norm.weight": (dim,), "output.weight": (vocab, dim)}
    for layer in range(PARAMS["n_layers"]):
        shapes.update({f"layers.{layer}.{name}": shape for name, shape in (
            ("attention_norm.weight", (dim,)), ("ffn_norm.weight", (dim,)), ("attention.wq.weight", (dim, dim)),
            ("attention.wk.weight", (kv_dim, dim)), ("attention.wv.weight", (kv_dim, dim)),
            ("attention.wo.weight", (dim, dim)), ("feed_forward.w1.weight", (FFN_DIM, dim)),
            ("feed_forward.w2.weight", (dim, FFN_DIM)), ("feed_forward.w3.weight", (FFN_DIM, dim)))})
    generator = torch.Generator().manual_seed(0)
    return {name: 0.1 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_tokens(directory: str, train_tokens: int = 8000, val_tokens: int = 2000) -> None:
    """train.bin and val.bin of random ids the model's vocabulary holds."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", train_tokens), ("val", val_tokens)):
        rng.integers(0, PARAMS["vocab_size"], count, dtype=np.uint16).tofile(os.path.join(directory, f"{split}.bin"))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write params.json and consolidated.00.pth")
    parser.add_argument("--tokens", help="where to write train.bin and val.bin for the model")
    args = parser.parse_args()
    os.makedirs(args.directory, exist_ok=True)
    with open(os.path.join(args.directory, "params.json"), "w") as handle:
        json.dump(PARAMS, handle)
    torch.save(meta_state(), os.path.join(args.directory, "consolidated.00.pth"))
    print(f"wrote params.json and consolidated.00.pth in {args.directory}")
    if args.tokens:
        write_tokens(args.tokens)
        print(f"wrote train.bin and val.bin in {args.tokens}")


if __name__ == "__main__":
    main()
