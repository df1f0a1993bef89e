"""`triax export RUN OUT`: a run's trained weights (its newest good snapshot) as one safetensors
file, or as a directory transformers' AutoModelForCausalLM loads (--format hf; a LoRA run's base
with its adapters merged in: --format hf --merge), nanoGPT's ckpt.pt (--format nanogpt), or a LoRA
run's adapters as PEFT's adapter directory (--format peft)."""

from __future__ import annotations

import argparse
import json
import os

from typing import TYPE_CHECKING

from triax import safe_files
from triax.arguments import ArgumentParser, FormOption, check_output_directory, written_by_triax_pickle
from triax.errors import UsageError, printable

if TYPE_CHECKING:
    from triax.checkpoint import SnapshotReader
    from triax.models import GPTConfig

FORMATS = ("safetensors", "hf", "nanogpt", "peft")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="triax export",
                            description="write a run's trained weights as one safetensors file, or "
                                        "(--format hf) a directory transformers' AutoModelForCausalLM loads")
    parser.add_argument("run_dir")
    parser.add_argument("output", help="path of the .safetensors file to write (--format hf, nanogpt, peft: a new "
                                       "directory)")
    # Once read, `--format peft` and `--merge` (which wins) name their form in errors, as their own parsers did.
    parser.add_argument("--format", action=FormOption, form="triax export --format peft", when="peft",
                        choices=FORMATS, default="safetensors",
                        help="nanogpt: OUTPUT is a directory for nanoGPT's ckpt.pt (its sample.py's out_dir); "
                             "peft: a LoRA run's adapters, adapter_config.json and adapter_model.safetensors")
    parser.add_argument("--merge", action=FormOption, switch=True, form="triax export --format hf --merge", rank=2,
                        help="with --format hf: a LoRA run's base with its adapters merged in, for transformers")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output file that triax did not write")
    args = parser.parse_args(argv)
    if args.merge and args.format != "hf":
        raise UsageError(f"--merge writes a transformers directory: give it with --format hf, not {args.format}")
    if args.merge and args.force:
        raise UsageError("--merge writes a new directory: leave out --force")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.merge:
        from triax.train.peft_export import export_merged_main  # deferred: torch and the models, after --help

        return export_merged_main(args.run_dir, args.output)
    if args.format == "peft":
        from triax.train.peft_export import export_peft_main  # deferred: torch and the models, after --help

        return export_peft_main(args.run_dir, args.output, args.force)
    if args.format == "hf":
        return export_hf_main(args.run_dir, args.output)
    if args.format == "nanogpt":
        return export_nanogpt_main(args.run_dir, args.output, args.force)
    return export_safetensors_main(args.run_dir, args.output, args.force)


def export_hf_main(run_dir: str, out_dir: str) -> int:
    # deferred: torch and the models, after --help
    from triax.checkpoint.export import tensor_source
    from triax.models import GPTConfig  # deferred: torch and the checkpoint layer, after --help
    from triax.interop.hf.export import export_hf  # deferred: torch and the checkpoint layer, after --help
    from triax.train.run_files import KEPT_SOURCE_DIR  # deferred: torch and the checkpoint layer, after --help
    # deferred: torch and the checkpoint layer, after --help
    from triax.train.runs import check_not_in_run, run_snapshot_root, true_shapes, with_fallback

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

    def export(reader: SnapshotReader, model_config: GPTConfig, vocab: object) -> tuple:
        true_config, shapes = true_shapes(model_config, vocab)
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


def export_nanogpt_main(run_dir: str, output: str, force: bool) -> int:
    # deferred: torch, after --help
    from triax.interop.nanogpt.export import export_nanogpt
    # deferred: torch and the checkpoint layer, after --help
    from triax.train.runs import check_not_in_run, run_snapshot_root, true_shapes, with_fallback

    root = run_snapshot_root(run_dir)
    check_not_in_run(output, run_dir, root, "OUTPUT")
    check_output_directory("OUTPUT", output, {"ckpt.pt": written_by_triax_pickle}, force)
    with_fallback(run_dir, root, lambda *opened: export_nanogpt(run_dir, output, opened, true_shapes))
    return 0


def export_safetensors_main(run_dir: str, output: str, force: bool) -> int:
    # deferred: torch, after --help
    from triax.checkpoint.export import export_safetensors
    # deferred: torch and the checkpoint layer, after --help
    from triax.train.runs import check_export_output, run_snapshot_root, true_shapes, with_fallback

    # The output is checked before any snapshot is read (the run's snapshot root found once).
    root = run_snapshot_root(run_dir)
    check_export_output(output, run_dir, force, root)

    def export(reader: SnapshotReader, model_config: GPTConfig, vocab: object) -> tuple:
        true_config, shapes = true_shapes(model_config, vocab)
        # Plain tensors with plain names, and the architecture and vocabulary as string metadata:
        # loadable with safetensors alone, no triax classes needed. Written tensor by tensor.
        metadata = {"format": "pt", "triax_model": json.dumps(true_config)}
        if vocab is not None and hasattr(vocab, "to_json"):
            metadata["triax_vocab"] = vocab.to_json()
        return (reader.snapshot, *export_safetensors(reader, output, shapes, metadata))

    snapshot, count, values = with_fallback(run_dir, root, export)
    print(printable(f"wrote {count} tensors ({values / 1e6:.2f}M values) from {snapshot} to {output}"))
    return 0
