"""`triax train`, `triax generate`, `triax export`."""

from __future__ import annotations

import argparse
import json
import os
import sys

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


def _run_files(run_dir: str):
    """(model config dict, vocabulary or None, snapshot root) of a run directory."""
    from triax.data import Vocabulary
    from triax.train.config import TrainConfig, from_dict, snapshot_root

    model_file = os.path.join(run_dir, "model.json")
    if not os.path.exists(model_file):
        raise TriaxError(f"{run_dir!r} is not a triax run directory (no model.json); "
                         "give the trainer.run_dir of a finished or running `triax train`")
    with open(model_file) as handle:
        model_config = json.load(handle)
    vocab = None
    vocab_file = os.path.join(run_dir, "vocab.json")
    if os.path.exists(vocab_file):
        with open(vocab_file) as handle:
            vocab = Vocabulary.from_json(handle.read())
    config = TrainConfig()
    config_file = os.path.join(run_dir, "config.yaml")
    if os.path.exists(config_file):
        import yaml

        try:
            with open(config_file) as handle:
                config = from_dict(yaml.safe_load(handle) or {})
        except Exception as error:  # noqa: BLE001 - a damaged run file is the user's to fix: one line
            raise TriaxError(f"{config_file!r} is not a valid run config ({type(error).__name__}); "
                             "restore it from the run, or give the run directory of a finished `triax train`") from None
    config.trainer.run_dir = run_dir  # the directory as given now, wherever the run was started
    return model_config, vocab, snapshot_root(config)


def newest_good_snapshot(root: str, run_dir: str):
    """The validated reader of the newest snapshot that passes validation (older ones are tried
    when the newest is damaged, as a resume would; nothing is moved: this is a read-only command)."""
    from triax import checkpoint

    snapshots = checkpoint.list_snapshots(root)
    if not snapshots:
        raise TriaxError(f"{run_dir!r} has no snapshot yet in {root}; wait for the first save "
                         "(trainer.save_every) or the end of training")
    for snapshot in reversed(snapshots):
        try:
            return checkpoint.open_snapshot(snapshot)
        except checkpoint.SnapshotCorruptError as error:
            print(f"triax: warning: {error}; trying the previous snapshot", file=sys.stderr)
    raise TriaxError(f"none of the {len(snapshots)} snapshot(s) in {root} passed verification")


def _true_shapes(model_config: dict, vocab_rows: int) -> tuple[dict, dict]:
    """(the model config without vocabulary padding, {tensor name: its unpadded shape})."""
    import torch

    from triax.models import GPT, GPTConfig

    padded = GPTConfig(**model_config)
    true_config = dict(model_config, vocab_size=min(vocab_rows, padded.vocab_size))
    # On the meta device: shapes only, no memory. The tensors whose shape changes with the
    # vocabulary are the ones that carry its padding.
    with torch.device("meta"):
        padded_shapes = {k: list(v.shape) for k, v in GPT(padded).state_dict().items()}
        true_shapes = {k: list(v.shape) for k, v in GPT(GPTConfig(**true_config)).state_dict().items()}
    return true_config, {k: v for k, v in true_shapes.items() if padded_shapes.get(k) != v}


def load_run_model(run_dir: str, device: str = "cpu"):
    """The trained plain GPT of a run directory (newest good snapshot) and its vocabulary,
    loaded tensor by tensor through the validating reader, vocabulary padding dropped."""
    from triax.checkpoint.export import load_module_streaming
    from triax.models import GPT, GPTConfig

    model_config, vocab, root = _run_files(run_dir)
    reader = newest_good_snapshot(root, run_dir)
    true_config, _ = _true_shapes(model_config, len(vocab) if vocab is not None else model_config["vocab_size"])
    model = GPT(GPTConfig(**true_config))
    load_module_streaming(reader, model)
    return model.to(device).eval(), vocab, reader.snapshot


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
    from triax.checkpoint.export import export_safetensors

    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
        raise TriaxError(f"the directory of {args.output!r} does not exist")
    model_config, vocab, root = _run_files(args.run_dir)
    reader = newest_good_snapshot(root, args.run_dir)
    true_config, shapes = _true_shapes(model_config, len(vocab) if vocab is not None else model_config["vocab_size"])
    # Plain tensors with plain names, and the architecture and vocabulary as string metadata:
    # loadable with safetensors alone, no triax classes needed.
    metadata = {"format": "pt", "triax_model": json.dumps(true_config)}
    if vocab is not None:
        metadata["triax_vocab"] = vocab.to_json()
    count, values = export_safetensors(reader, args.output, shapes, metadata)
    print(f"wrote {count} tensors ({values / 1e6:.2f}M values) from {reader.snapshot} to {args.output}")
    return 0
