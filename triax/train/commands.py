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
  triax train data.task=tokens data.path=tokens/   # a directory from `triax tokenize` or nanoGPT
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
    vocab = load_run_vocab(run_dir)
    return model.to(device).eval(), vocab, snapshot


def load_run_vocab(run_dir: str):
    """The run's text codec: its tokenizer.json (data.task=tokens) or vocab.json (characters), else None."""
    from triax.data import Vocabulary

    tokenizer_file = os.path.join(run_dir, "tokenizer.json")
    if os.path.exists(tokenizer_file):
        from triax.data.tokenizer import BPETokenizer

        return BPETokenizer.from_file(tokenizer_file)
    vocab = None
    vocab_file = os.path.join(run_dir, "vocab.json")
    if os.path.exists(vocab_file):
        with open(vocab_file) as handle:
            vocab = Vocabulary.from_json(handle.read())
    return vocab


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
    parser.add_argument("--tokens", type=int, default=300, help="tokens (characters for a char run) to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely character")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    model, vocab, _ = load_run_model(args.run_dir, args.device)
    if vocab is None:
        raise TriaxError(f"{args.run_dir!r} has no vocab.json or tokenizer.json (trained on ids without a "
                         "tokenizer, or on the addition task); nothing to decode text with")
    prompt_ids = vocab.encode(args.prompt)
    if not prompt_ids:
        raise TriaxError(f"--prompt {args.prompt!r} encodes to no tokens; give at least one character")
    idx = torch.tensor([prompt_ids], device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         vocab_limit=min(len(vocab), model.config.vocab_size),
                         greedy=args.greedy, generator=generator)
    print(vocab.decode(out[0].tolist()))
    return 0


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="triax export",
                                     description="write a run's trained weights as one safetensors file, or "
                                                 "(--format hf) a directory transformers' GPT2LMHeadModel loads")
    parser.add_argument("run_dir")
    parser.add_argument("output", help="path of the .safetensors file to write (--format hf: a new directory)")
    parser.add_argument("--format", choices=("safetensors", "hf"), default="safetensors")
    args = parser.parse_args(argv)
    if args.format == "hf":
        return export_hf_main(args.run_dir, args.output)
    from safetensors.torch import save_file

    model, vocab, snapshot = load_run_model(args.run_dir)
    # Plain tensors with plain names, and the architecture and vocabulary as string metadata:
    # loadable with safetensors alone, no triax classes needed.
    metadata = {"format": "pt", "triax_model": json.dumps(model.config.__dict__)}
    if vocab is not None:
        metadata["triax_vocab"] = vocab.to_json()
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        raise TriaxError(f"the directory of {args.output!r} does not exist")
    tmp = args.output + ".tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, args.output)  # never a half-written export under the final name
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()) / 1e6:.2f}M values) "
          f"from {snapshot} to {args.output}")
    return 0


def export_hf_main(run_dir: str, out_dir: str) -> int:
    from triax import checkpoint
    from triax.models import GPTConfig
    from triax.train.hf_export import export_hf

    model_file = os.path.join(run_dir, "model.json")
    if not os.path.exists(model_file):
        raise TriaxError(f"{run_dir!r} is not a triax run directory (no model.json); "
                         "give the trainer.run_dir of a finished or running `triax train`")
    with open(model_file) as handle:
        config = GPTConfig(**json.load(handle))
    snapshot = checkpoint.latest_snapshot(_snapshot_root(run_dir))
    if snapshot is None:
        raise TriaxError(f"{run_dir!r} has no snapshot yet; wait for the first save or the end of training")
    # The converter takes any name -> tensor source; today the snapshot's tensors, read whole.
    source = checkpoint.read_model_tensors(snapshot)
    tokenizer = os.path.join(run_dir, "tokenizer.json")
    tokenizer = tokenizer if os.path.exists(tokenizer) else None
    values = export_hf(config, source, out_dir, tokenizer)
    note = " with its tokenizer" if tokenizer else (" (character vocabulary: no Hugging Face tokenizer written)"
                                                    if os.path.exists(os.path.join(run_dir, "vocab.json")) else "")
    print(f"wrote a transformers GPT-2 ({values / 1e6:.2f}M values) from {snapshot} to {out_dir}{note}")
    return 0
