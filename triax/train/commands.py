"""`triax generate` and `triax export` (`triax train` is triax/train/train_command.py)."""

from __future__ import annotations

import json
import math
import os
import sys

from triax import safe_files
from triax.errors import TriaxError, UsageError, printable

# Below this the logits divided by the temperature overflow float32 (probabilities of NaN); above
# it sampling is uniform in all but name.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
MAX_GENERATE_TOKENS = 1_000_000
# Where a run's config.yaml may keep its snapshots (the object stores triax documents).
SNAPSHOT_SCHEMES = ("file", "memory", "s3", "gs", "gcs", "az", "abfs")


def _snapshot_root(run_dir: str) -> str:
    """Where the run keeps its snapshots: its config.yaml's trainer.snapshot_dir, else
    <run_dir>/snapshots (the trainer's own rule, triax.train.config.snapshot_root)."""
    from triax.train.config import TrainConfig, from_dict, snapshot_root

    config = TrainConfig()
    config_file = os.path.join(run_dir, "config.yaml")
    if os.path.lexists(config_file):
        from triax import safe_yaml

        try:
            # No link, FIFO or huge file (safe_files), no alias bomb or deep nesting (safe_yaml),
            # and nothing outside the run read or reached.
            config = from_dict(safe_yaml.loads(safe_files.read_text(config_file), config_file) or {})
        except Exception as error:  # noqa: BLE001 - a damaged run file is the user's to fix: one line
            raise TriaxError(f"{config_file!r} is not a valid run config ({type(error).__name__}); "
                             "restore it from the run, or give the run directory of a finished `triax train`") from None
    location = config.trainer.snapshot_dir or ""
    scheme = location.split("://", 1)[0].lower() if "://" in location else "file"
    if scheme not in SNAPSHOT_SCHEMES:
        # A run directory may come from someone else: its config must not make this command
        # connect to an arbitrary host (ftp://, http://, ssh://...).
        raise TriaxError(f"{config_file!r} names trainer.snapshot_dir {location[:200]!r}, a {scheme}:// location "
                         f"triax does not read snapshots from; use one of {', '.join(SNAPSHOT_SCHEMES)}:// "
                         "or copy the snapshots into the run directory")
    config.trainer.run_dir = run_dir  # the directory as given now, wherever the run was started
    return snapshot_root(config)


def newest_good_snapshot(root: str, run_dir: str, skip: int = 0):
    """The validated reader of the newest snapshot that passes validation (older ones are tried
    when the newest is damaged, as a resume would; nothing is moved: this is a read-only command),
    passing over the first `skip` good ones (whose tensor bytes a caller found damaged)."""
    from triax import checkpoint

    snapshots = checkpoint.list_snapshots(root)
    if not snapshots:
        raise TriaxError(f"{run_dir!r} has no snapshot yet in {root}; wait for the first save "
                         "(the first evaluation, trainer.save_every) or the end of training")
    for snapshot in reversed(snapshots):
        try:
            reader = checkpoint.open_snapshot(snapshot)
        except checkpoint.SnapshotCorruptError as error:
            print(printable(f"triax: warning: {error}; trying the previous snapshot"), file=sys.stderr)
            continue
        if skip == 0:
            return reader
        skip -= 1
    raise TriaxError(f"none of the {len(snapshots)} snapshot(s) in {root} passed verification")


def check_exists(path: str, what: str) -> None:
    """A directory a command reads must exist; a relative one is named with where it was looked
    for (the current directory), the usual slip being a command run from another directory."""
    if not os.path.lexists(path):
        where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
        raise TriaxError(f"{path!r} does not exist{where}; give {what}")


def run_snapshot_root(run_dir: str) -> str:
    """The snapshot root of a run directory; one line if `run_dir` is not a run."""
    check_exists(run_dir, "the trainer.run_dir of a `triax train` run")
    if not os.path.isfile(os.path.join(run_dir, "model.json")):
        raise TriaxError(f"{run_dir!r} is not a triax run directory (no model.json); "
                         "give the trainer.run_dir of a finished or running `triax train`")
    return _snapshot_root(run_dir)


def open_run(run_dir: str, snapshot_root: str | None = None, skip: int = 0):
    """(validated reader of the newest good snapshot, the checked model config, the text codec or
    None) of a run directory; `skip`: see newest_good_snapshot. model.json is checked against the
    snapshot before anything is allocated: a damaged one must not make us build a model of terabytes."""
    from triax.train.run_files import read_model_config, read_vocabulary

    root = snapshot_root or run_snapshot_root(run_dir)
    reader = newest_good_snapshot(root, run_dir, skip)
    model_config = read_model_config(run_dir, reader)  # matched against its tensors before building
    return reader, model_config, read_vocabulary(run_dir, model_config.vocab_size)


def with_fallback(run_dir: str, root: str, action):
    """`action(reader, model_config, vocab)` on the newest good snapshot; when its tensor bytes
    turn out damaged (a chunk fails its sha256, found only when it is read), on the one before,
    as a resume falls back. Read-only: nothing is moved aside."""
    from triax import checkpoint  # deferred: imports torch; `triax --help` stays fast

    skip = 0
    while True:
        opened = open_run(run_dir, root, skip)
        try:
            return action(*opened)
        except checkpoint.SnapshotCorruptError as error:
            print(printable(f"triax: warning: {error}; trying the previous snapshot"), file=sys.stderr)
            skip += 1


def _true_shapes(model_config, vocab) -> tuple[dict, dict]:
    """(the model config without tensor-parallel vocabulary padding, {tensor name: its unpadded
    shape} of the tensors the padding extends). The snapshot's own rows may differ from
    model.json's padding: a run resumed in another layout writes model.json before its first
    snapshot, and every layout's padding rows are zero."""
    import dataclasses

    import torch

    from triax.data import Vocabulary
    from triax.models import VOCABULARY_PARAMETERS, GPTConfig, build_model

    values = dataclasses.asdict(model_config)
    # model.json's vocab_size is the true vocabulary; padded_vocab_size the rows tensor
    # parallelism added (zero, masked, never sampled).
    rows = len(vocab) if isinstance(vocab, Vocabulary) else model_config.vocab_size
    true_config = dict(values, vocab_size=min(rows, model_config.vocab_size), padded_vocab_size=None)
    with torch.device("meta"):  # shapes only, no memory
        true_shapes = {k: list(v.shape) for k, v in build_model(GPTConfig(**true_config)).state_dict().items()}
    return true_config, {k: v for k, v in true_shapes.items() if k in VOCABULARY_PARAMETERS}


def load_run_model(run_dir: str, device: str = "cpu", opened=None):
    """The trained plain model of a run directory (newest good snapshot) and its text codec,
    loaded tensor by tensor through the validating reader, vocabulary padding dropped."""
    # deferred: torch and the models, for the commands that load a model only
    import torch

    from triax.checkpoint.export import load_module_streaming
    from triax.models import GPTConfig, build_model
    from triax.models.memory import check_whole_model_fits  # deferred: loads torch
    from triax.runtime.place import detect_place  # deferred: with the model

    reader, model_config, vocab = opened or open_run(run_dir)
    true_config, _ = _true_shapes(model_config, vocab)
    config = GPTConfig(**true_config)
    # Built whole on this host: a model.json of terabytes is one line, before anything is allocated.
    check_whole_model_fits(config, torch.device("cpu"), os.path.join(run_dir, "model.json"),
                           detect_place().local_world_size)
    model = build_model(config)
    load_module_streaming(reader, model)
    return model.to(device).eval(), vocab, reader.snapshot


def generate_main(argv: list[str]) -> int:
    import torch

    from triax.arguments import ArgumentParser, at_least, check_device, need
    from triax.runtime.place import pick_device

    parser = ArgumentParser(prog="triax generate", description="sample text from a trained run")
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--tokens", type=int, default=300, help="tokens (characters for a char run) to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--greedy", action="store_true",
                        help="always take the most likely token (a character in a character-level run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    # Every argument is checked before the model is read or built.
    need(args.prompt != "", "--prompt", args.prompt, "give at least one character to start from")
    at_least("--tokens", args.tokens, 0)
    need(args.tokens <= MAX_GENERATE_TOKENS, "--tokens", args.tokens,
         f"use at most {MAX_GENERATE_TOKENS} (generation is one forward pass per token)")
    if not args.greedy:  # --greedy ignores the temperature
        need(math.isfinite(args.temperature) and MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE,
             "--temperature", args.temperature,
             f"use a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (e.g. 0.8), or --greedy for the most "
             "likely token")
    if args.top_k is not None:
        at_least("--top-k", args.top_k, 1)
    need(0 <= args.seed < 2**63, "--seed", args.seed, "use 0 .. 2**63-1")
    check_device("--device", args.device)
    device = pick_device(args.device)
    if device.type == "cpu":
        from triax.runtime.threads import apply_thread_choice  # deferred: as the imports above

        apply_thread_choice()  # the cores idle now (triax.runtime.threads: why)

    def load(*opened):
        vocab = opened[2]
        if vocab is None:
            raise TriaxError(f"{args.run_dir!r} has no vocab.json or tokenizer.json (trained on ids without a "
                             "tokenizer, or on the addition task); nothing to decode text with")
        prompt_ids = vocab.encode(args.prompt)  # one line naming characters the run never saw
        if not prompt_ids:
            raise TriaxError(f"--prompt {args.prompt!r} encodes to no tokens; give at least one character")
        model, vocab, _ = load_run_model(args.run_dir, device, opened)
        return model, vocab, prompt_ids

    model, vocab, prompt_ids = with_fallback(args.run_dir, run_snapshot_root(args.run_dir), load)
    idx = torch.tensor([prompt_ids], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k,
                         vocab_limit=min(len(vocab), model.config.vocab_size),
                         greedy=args.greedy, generator=generator)
    text = vocab.decode(out[0].tolist())
    # Exactly the text into a file or a pipe; on a terminal, no escape sequence the data taught it.
    print(printable(text, keep="\n\t") if sys.stdout.isatty() else text)
    return 0


def check_export_output(output: str, run_dir: str, force: bool, snapshot_root: str) -> None:
    """Refuse, before any work, an output that is a directory, lies in a missing directory, is one
    of the run's own files or inside its snapshots, or is a file triax did not write (without --force)."""
    from triax.arguments import check_output_file, written_by_triax_safetensors

    check_not_in_run(output, run_dir, snapshot_root)
    check_output_file("output", output, force, written_by_triax_safetensors)


def check_not_in_run(output: str, run_dir: str, snapshot_root: str, option: str = "output") -> None:
    """Refuse an output inside the run's snapshots (the next prune would delete it) or one of the
    run's own files."""
    target = os.path.realpath(output)
    protected = [os.path.realpath(snapshot_root)] if "://" not in snapshot_root else []
    if any(target == root or target.startswith(root + os.sep) for root in protected):
        raise UsageError(f"{option} {output!r} lies inside the run's snapshots ({protected[0]}); "
                         "write the export somewhere else")
    from triax.train.run_files import KEPT_SOURCE_DIR  # deferred: run_files loads torch, which `triax --help` need not

    kept = os.path.realpath(os.path.join(run_dir, KEPT_SOURCE_DIR))
    if target == kept or target.startswith(kept + os.sep):
        # The run's copies of its model.init_from files: its next start replaces them.
        raise UsageError(f"{option} {output!r} lies inside the run's {KEPT_SOURCE_DIR}/ ({kept}), which the run's next "
                         "start rewrites; write the export somewhere else")
    if os.path.dirname(target) == os.path.realpath(run_dir) and os.path.basename(target) in RUN_FILES:
        raise UsageError(f"{option} {output!r} is the run's own {os.path.basename(target)}; "
                         "write the export somewhere else")


# Files of a run directory that `triax train` writes and generate/export/resume read.
RUN_FILES = ("model.json", "vocab.json", "config.yaml", "metrics.jsonl")


def export_main(argv: list[str]) -> int:
    from triax.arguments import ArgumentParser

    parser = ArgumentParser(prog="triax export",
                            description="write a run's trained weights as one safetensors file, or "
                                        "(--format hf) a directory transformers' AutoModelForCausalLM loads")
    parser.add_argument("run_dir")
    parser.add_argument("output", help="path of the .safetensors file to write (--format hf: a new directory)")
    parser.add_argument("--format", choices=("safetensors", "hf", "nanogpt"), default="safetensors",
                        help="nanogpt: OUTPUT is a directory for nanoGPT's ckpt.pt (its sample.py's out_dir)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output file that triax did not write")
    args = parser.parse_args(argv)
    if args.format == "hf":
        return export_hf_main(args.run_dir, args.output)
    if args.format == "nanogpt":
        from triax.interop.nanogpt.export import export_nanogpt

        from triax.arguments import check_output_directory, written_by_triax_pickle

        root = run_snapshot_root(args.run_dir)
        check_not_in_run(args.output, args.run_dir, root, "OUTPUT")
        check_output_directory("OUTPUT", args.output, {"ckpt.pt": written_by_triax_pickle}, args.force)
        with_fallback(args.run_dir, root, lambda *opened: export_nanogpt(args.run_dir, args.output, opened,
                                                                          _true_shapes))
        return 0
    from triax.checkpoint.export import export_safetensors

    # The output is checked before any snapshot is read (the run's snapshot root found once).
    root = run_snapshot_root(args.run_dir)
    check_export_output(args.output, args.run_dir, args.force, root)

    def export(reader, model_config, vocab):
        true_config, shapes = _true_shapes(model_config, vocab)
        # Plain tensors with plain names, and the architecture and vocabulary as string metadata:
        # loadable with safetensors alone, no triax classes needed. Written tensor by tensor.
        metadata = {"format": "pt", "triax_model": json.dumps(true_config)}
        if vocab is not None and hasattr(vocab, "to_json"):
            metadata["triax_vocab"] = vocab.to_json()
        return (reader.snapshot, *export_safetensors(reader, args.output, shapes, metadata))

    snapshot, count, values = with_fallback(args.run_dir, root, export)
    print(printable(f"wrote {count} tensors ({values / 1e6:.2f}M values) from {snapshot} to {args.output}"))
    return 0


def export_hf_main(run_dir: str, out_dir: str) -> int:
    from triax.checkpoint.export import tensor_source
    from triax.interop.hf.export import export_hf
    from triax.train.run_files import KEPT_SOURCE_DIR

    from triax.models import GPTConfig

    root = run_snapshot_root(run_dir)
    check_not_in_run(out_dir, run_dir, root, "OUT_DIR")
    tokenizer = os.path.join(run_dir, "tokenizer.json")
    tokenizer = tokenizer if safe_files.is_regular(tokenizer) else None
    # A run started from a transformers checkpoint kept its config and tokenizer files there.
    kept = os.path.join(run_dir, KEPT_SOURCE_DIR)
    if os.path.lexists(kept) and not safe_files.is_directory(kept):
        # Left out silently, the export would lack the checkpoint's generation config and token ids.
        raise UsageError(f"{kept} is a link or not a directory; it should hold the copies triax made of the files "
                         "of the run's model.init_from checkpoint: remove it and start the run again (triax train "
                         "keeps them anew), or export with the plain safetensors format")
    kept = kept if safe_files.is_directory(kept) else None

    def export(reader, model_config, vocab):
        true_config, shapes = _true_shapes(model_config, vocab)
        # The converter reads one tensor at a time from the validated snapshot (padding rows cut).
        source = tensor_source(reader, shapes)
        return reader.snapshot, (export_hf(GPTConfig(**true_config), source, out_dir, tokenizer, kept),
                                 model_config.arch)

    snapshot, (values, arch) = with_fallback(run_dir, root, export)
    note = " with its tokenizer" if tokenizer else (" (character vocabulary: no Hugging Face tokenizer written)"
                                                    if os.path.exists(os.path.join(run_dir, "vocab.json")) else "")
    if kept is not None:
        note += ", and the config, generation and tokenizer files of the checkpoint it was started from"
    print(printable(f"wrote a transformers {arch} model ({values / 1e6:.2f}M values) from {snapshot} to "
                    f"{out_dir}{note}"))
    return 0
