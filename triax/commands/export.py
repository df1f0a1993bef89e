"""`triax export RUN OUT`: a run's trained weights (its newest good snapshot) as one safetensors
file, or as a directory transformers' AutoModelForCausalLM loads (--format hf; a LoRA run's base
with its adapters merged in: --format hf --merge), nanoGPT's ckpt.pt (--format nanogpt), or a LoRA
run's adapters as PEFT's adapter directory (--format peft)."""

from __future__ import annotations

import argparse

from triax.arguments import ArgumentParser, FormOption
from triax.errors import UsageError

# The writers' names in triax/interop/exporters.py's EXPORTERS (named here so --help imports no torch).
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
    # deferred: torch, the models and the checkpoint layer, after --help
    from triax.interop.exporters import EXPORTERS, OUTPUT_PLACES, ExportOptions
    from triax.runs.export import RunToExport  # deferred: as above

    from triax.runs.output_place import check_output_place  # deferred: as above

    run = RunToExport(args.run_dir)  # one line if RUN is not a run directory, before the output is checked
    # Made or refused before any snapshot is read: a file (safetensors) or a new directory (the rest).
    option, directory = OUTPUT_PLACES[args.format]
    check_output_place(option, args.output, directory)
    EXPORTERS[args.format](run, args.output, ExportOptions(force=args.force, merge=args.merge))
    return 0
