"""`triax train`, `triax generate`, `triax export`."""

from __future__ import annotations

import argparse
import json
import os

from triax.errors import TriaxError

TRAIN_HELP = """usage: triax train [key=value ...] [model=PRESET] [+experiment=NAME]

Train a GPT. With no arguments: a small model on the built-in corpus (about a minute on 2 CPU
cores). Run under torchrun (or `triax launch`) for several processes.

examples:
  triax train
  triax train model=gpt-mini trainer.max_steps=1000 data.path=input.txt
  triax train data.task=addition trainer.max_steps=2000
  torchrun --nproc-per-node 4 -m triax train trainer.precision=bf16

keys (default, meaning):
"""


def train_main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        from triax.train.config import describe_keys

        print(TRAIN_HELP + describe_keys())
        return 0
    import time

    from triax.runtime import barrier, shutdown_distributed
    from triax.train.config import compose_config
    from triax.train.trainer import Trainer

    config = compose_config(argv)
    try:
        trainer = Trainer(config)
        trainer.fit()
        # Free the DDP model while the process group is still registered, then let gloo's worker
        # threads finish with their last work items (sleeping releases the GIL) before the group
        # is torn down: tearing it down while a worker still needs the GIL can hang at exit.
        del trainer
        barrier()
        time.sleep(0.05)
    finally:
        shutdown_distributed()
    return 0


def load_run_model(run_dir: str, device: str = "cpu"):
    """The trained plain GPT of a run directory (latest snapshot) and its vocabulary."""
    from triax import checkpoint
    from triax.data import Vocabulary
    from triax.models import GPT, GPTConfig

    model_file = os.path.join(run_dir, "model.json")
    if not os.path.exists(model_file):
        raise TriaxError(f"{run_dir!r} is not a triax run directory (no model.json); "
                         "give the trainer.run_dir of a finished or running `triax train`")
    with open(model_file) as handle:
        model = GPT(GPTConfig(**json.load(handle)))
    snapshot_root = _snapshot_root(run_dir)
    snapshot = checkpoint.latest_snapshot(snapshot_root)
    if snapshot is None:
        raise TriaxError(f"{run_dir!r} has no snapshot yet in {snapshot_root}; wait for the first save "
                         "(trainer.save_every) or the end of training")
    model.load_state_dict(checkpoint.read_model_tensors(snapshot))
    vocab = None
    vocab_file = os.path.join(run_dir, "vocab.json")
    if os.path.exists(vocab_file):
        with open(vocab_file) as handle:
            vocab = Vocabulary.from_json(handle.read())
    return model.to(device).eval(), vocab, snapshot


def _snapshot_root(run_dir: str) -> str:
    """trainer.snapshot_dir from the run's config.yaml, else <run_dir>/snapshots."""
    import yaml

    config_file = os.path.join(run_dir, "config.yaml")
    if os.path.exists(config_file):
        with open(config_file) as handle:
            snapshot_dir = ((yaml.safe_load(handle) or {}).get("trainer") or {}).get("snapshot_dir")
        if snapshot_dir:
            return snapshot_dir
    return os.path.join(run_dir, "snapshots")


def generate_main(argv: list[str]) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="triax generate", description="sample text from a trained run")
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--tokens", type=int, default=300, help="characters to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely character")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    model, vocab, _ = load_run_model(args.run_dir, args.device)
    if vocab is None:
        raise TriaxError(f"{args.run_dir!r} was not trained on text (no vocab.json); nothing to generate")
    idx = torch.tensor([vocab.encode(args.prompt)], device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         vocab_limit=len(vocab),
                         greedy=args.greedy, generator=generator)
    print(vocab.decode(out[0].tolist()))
    return 0


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="triax export",
                                     description="write a run's trained weights as one safetensors file")
    parser.add_argument("run_dir")
    parser.add_argument("output", help="path of the .safetensors file to write")
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    model, vocab, snapshot = load_run_model(args.run_dir)
    # Plain tensors with plain names, and the architecture and vocabulary as string metadata:
    # loadable with safetensors alone, no triax classes needed.
    # A vocabulary padded for tensor parallelism is written without its padding rows: the file
    # holds the model's true shape (the rows are zero and masked out, so nothing is lost).
    config = dict(model.config.__dict__, padded_vocab_size=None)
    metadata = {"format": "pt", "triax_model": json.dumps(config)}
    if vocab is not None:
        metadata["triax_vocab"] = vocab.to_json()
    vocab_size = model.config.vocab_size
    tensors = {name: (tensor[:vocab_size] if name in ("tok_emb.weight", "lm_head.weight") else tensor)
               .detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        raise TriaxError(f"the directory of {args.output!r} does not exist")
    tmp = args.output + ".tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, args.output)  # never a half-written export under the final name
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()) / 1e6:.2f}M values) "
          f"from {snapshot} to {args.output}")
    return 0
