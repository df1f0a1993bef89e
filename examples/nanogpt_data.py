"""Write token files in the layout nanoGPT's data/<name>/prepare.py writes (train.bin and val.bin:
flat uint16 arrays of GPT-2 token ids): a stand-in for nanoGPT's prepared OpenWebText to try the
nanoGPT commands of docs/switching.md with, on a CPU, with nothing downloaded.

    python examples/nanogpt_data.py nanogpt/data/openwebtext

The ids are drawn at random (seeded) from GPT-2's 50,257 tokens: enough to train on and to export,
not a corpus a model can learn.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

GPT2_VOCAB = 50257  # the ids tiktoken's gpt2 encoding gives, as prepare.py writes them


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where to write train.bin and val.bin")
    parser.add_argument("--train-tokens", type=int, default=20000)
    parser.add_argument("--val-tokens", type=int, default=4000)
    args = parser.parse_args()
    os.makedirs(args.directory, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", args.train_tokens), ("val", args.val_tokens)):
        rng.integers(0, GPT2_VOCAB, count, dtype=np.uint16).tofile(os.path.join(args.directory, f"{split}.bin"))
    print(f"wrote train.bin ({args.train_tokens} tokens) and val.bin ({args.val_tokens} tokens) "
          f"in {args.directory}")


if __name__ == "__main__":
    main()
