"""Write a tiny random Llama as torchtitan's checkpoint folder (OUT/step-<N>: the model's tensors
under `model.`, in Meta's names and rotary order, as torch.distributed.checkpoint's .metadata and
.distcp files), with token files for it: a stand-in for a torchtitan run to try the torchtitan
commands of docs/switching.md with, on a CPU, with nothing downloaded.

    python examples/torchtitan_checkpoint.py outputs/checkpoint --tokens llama_tokens

The model is examples/meta_llama_folder.py's (2 layers, 32 wide, 4 query heads over 2 key/value
heads, 512 tokens). Only the model is written: triax reads nothing else of a torchtitan checkpoint.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch.distributed.checkpoint as dcp

from meta_llama_folder import meta_state, write_tokens  # this folder's sibling script


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the checkpoint folder, where step-<N> is written")
    parser.add_argument("--step", type=int, default=10)
    parser.add_argument("--tokens", help="where to write train.bin and val.bin for the model")
    args = parser.parse_args()
    folder = os.path.join(args.directory, f"step-{args.step}")
    with warnings.catch_warnings():  # one process with no process group is what this script means
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": meta_state()}, checkpoint_id=folder, no_dist=True)
    print(f"wrote {folder}")
    if args.tokens:
        write_tokens(args.tokens)
        print(f"wrote train.bin and val.bin in {args.tokens}")


if __name__ == "__main__":
    main()
