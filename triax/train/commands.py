"""`triax train`, `triax generate`, `triax export`."""

from __future__ import annotations

import json
import math
import os
import tempfile

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

Only the keys below exist (with or without +); values are literal (no ${...} interpolation).
hydra.searchpath=[file://DIR] lets +experiment=NAME read your own DIR/experiment/NAME.yaml.

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
    from triax.models import GPT
    from triax.train.run_files import read_model_config, read_vocabulary

    snapshot = find_run_snapshot(run_dir)
    # Checked against the snapshot before anything is allocated (a damaged model.json must not
    # make us build a model of terabytes).
    model_config = read_model_config(run_dir, snapshot)
    vocab = read_vocabulary(run_dir, model_config.vocab_size)
    model = GPT(model_config)
    model.load_state_dict(checkpoint.read_model_tensors(snapshot))
    return model.to(device).eval(), vocab, snapshot


def find_run_snapshot(run_dir: str) -> str:
    """The newest snapshot of a run directory; one line if it is not a run or has none yet."""
    from triax import checkpoint

    if not os.path.isfile(os.path.join(run_dir, "model.json")):
        raise TriaxError(f"{run_dir!r} is not a triax run directory (no model.json); "
                         "give the trainer.run_dir of a finished or running `triax train`")
    snapshot_root = _snapshot_root(run_dir)
    snapshot = checkpoint.latest_snapshot(snapshot_root)
    if snapshot is None:
        raise TriaxError(f"{run_dir!r} has no snapshot yet in {snapshot_root}; wait for the first save "
                         "(trainer.save_every) or the end of training")
    return snapshot


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

    from triax.arguments import ArgumentParser, at_least, check_device, need
    from triax.runtime import pick_device
    from triax.train.run_files import read_model_config, read_vocabulary

    parser = ArgumentParser(prog="triax generate", description="sample text from a trained run")
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--tokens", type=int, default=300, help="tokens (characters for a char run) to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely character")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    # Every argument is checked before the model is read or built.
    need(args.prompt != "", "--prompt", args.prompt, "give at least one character to start from")
    at_least("--tokens", args.tokens, 0)
    if not args.greedy:  # --greedy ignores the temperature
        need(math.isfinite(args.temperature) and args.temperature > 0, "--temperature", args.temperature,
             "use a number above 0 (e.g. 0.8), or --greedy for the most likely character")
    if args.top_k is not None:
        at_least("--top-k", args.top_k, 1)
    need(0 <= args.seed < 2**63, "--seed", args.seed, "use 0 .. 2**63-1")
    check_device("--device", args.device)
    device = pick_device(args.device)
    snapshot = find_run_snapshot(args.run_dir)
    model_config = read_model_config(args.run_dir, snapshot)
    vocab = read_vocabulary(args.run_dir, model_config.vocab_size)
    if vocab is None:
        raise TriaxError(f"{args.run_dir!r} has no vocab.json or tokenizer.json (trained on ids without a "
                         "tokenizer, or on the addition task); nothing to decode text with")
    prompt_ids = vocab.encode(args.prompt)  # one line naming characters the run never saw
    if not prompt_ids:
        raise TriaxError(f"--prompt {args.prompt!r} encodes to no tokens; give at least one character")
    model, vocab, _ = load_run_model(args.run_dir, device)
    idx = torch.tensor([prompt_ids], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         vocab_limit=min(len(vocab), model.config.vocab_size),
                         greedy=args.greedy, generator=generator)
    print(vocab.decode(out[0].tolist()))
    return 0


def check_export_output(output: str, run_dir: str, force: bool) -> None:
    """Refuse, before any work, an output that is a directory, lies in a missing directory, is one
    of the run's own files or inside its snapshots, or is a file triax did not write (without --force)."""
    from triax.arguments import check_output_file, written_by_triax_safetensors
    from triax.errors import UsageError

    check_output_file("output", output, force, written_by_triax_safetensors)
    target = os.path.realpath(output)
    protected = [os.path.realpath(_snapshot_root(run_dir))]
    if any(target == root or target.startswith(root + os.sep) for root in protected):
        raise UsageError(f"output {output!r} lies inside the run's snapshots ({protected[0]}); "
                         "write the export somewhere else")
    if os.path.dirname(target) == os.path.realpath(run_dir) and os.path.basename(target) in RUN_FILES:
        raise UsageError(f"output {output!r} is the run's own {os.path.basename(target)}; "
                         "write the export somewhere else")


# Files of a run directory that `triax train` writes and generate/export/resume read.
RUN_FILES = ("model.json", "vocab.json", "config.yaml", "metrics.jsonl")


def export_main(argv: list[str]) -> int:
    from triax.arguments import ArgumentParser

    parser = ArgumentParser(prog="triax export",
                            description="write a run's trained weights as one safetensors file, or "
                                        "(--format hf) a directory transformers' GPT2LMHeadModel loads")
    parser.add_argument("run_dir")
    parser.add_argument("output", help="path of the .safetensors file to write (--format hf: a new directory)")
    parser.add_argument("--format", choices=("safetensors", "hf"), default="safetensors")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output file that triax did not write")
    args = parser.parse_args(argv)
    if args.format == "hf":
        return export_hf_main(args.run_dir, args.output)
    from safetensors.torch import save_file

    find_run_snapshot(args.run_dir)
    check_export_output(args.output, args.run_dir, args.force)
    model, vocab, snapshot = load_run_model(args.run_dir)
    # Plain tensors with plain names, and the architecture and vocabulary as string metadata:
    # loadable with safetensors alone, no triax classes needed.
    metadata = {"format": "pt", "triax_model": json.dumps(model.config.__dict__)}
    if vocab is not None:
        metadata["triax_vocab"] = vocab.to_json()
    tensors = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    directory = os.path.dirname(os.path.abspath(args.output))
    # A fresh hidden name beside the output (never someone's "<output>.tmp"), removed if anything
    # fails: never a half-written export under the final name, never a leftover.
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(args.output)}.", suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, args.output)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()) / 1e6:.2f}M values) "
          f"from {snapshot} to {args.output}")
    return 0


def export_hf_main(run_dir: str, out_dir: str) -> int:
    from triax import checkpoint
    from triax.train.hf_export import export_hf
    from triax.train.run_files import read_model_config

    snapshot = find_run_snapshot(run_dir)
    config = read_model_config(run_dir, snapshot)
    # The converter takes any name -> tensor source; today the snapshot's tensors, read whole.
    source = checkpoint.read_model_tensors(snapshot)
    tokenizer = os.path.join(run_dir, "tokenizer.json")
    tokenizer = tokenizer if os.path.exists(tokenizer) else None
    values = export_hf(config, source, out_dir, tokenizer)
    note = " with its tokenizer" if tokenizer else (" (character vocabulary: no Hugging Face tokenizer written)"
                                                    if os.path.exists(os.path.join(run_dir, "vocab.json")) else "")
    print(f"wrote a transformers GPT-2 ({values / 1e6:.2f}M values) from {snapshot} to {out_dir}{note}")
    return 0
