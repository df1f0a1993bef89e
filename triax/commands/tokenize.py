"""`triax tokenize`: text files -> a token directory for `data.task=tokens` (triax.data.tokenize_files);
with `--chat CHECKPOINT`, chat files -> the ids and answer masks a `data.task=chat` run trains on
(triax.data.tokenize_chat); with `--preference CHECKPOINT`, preference pairs -> the ids TRL's
DPOTrainer trains on (triax.data.tokenize_preference). One parser for the three: an option of
another form is refused as unknown, as each form's own parser did."""

from __future__ import annotations

import argparse
import os

from triax.arguments import ArgumentParser, FormOption, plain_message
from triax.data.errors import DataError
from triax.data.length_rules import OVERLONG_RULES, TRUNCATION_MODES
from triax.data.tokenize_files import MIN_VOCAB_SIZE
from triax.runtime.threads import TOKENIZER_THREADS_ENV, apply_thread_choice

PROG = "triax tokenize"
MAX_WORKERS = 256  # processes; more is a typo, not a machine
# The options only one form takes (by destination), and each form's defaults for them.
TEXT_ONLY = {"vocab_size": "--vocab-size", "tokenizer": "--tokenizer", "workers": "--workers", "format": "--format",
             "text_field": "--text-field"}
RECORDS_ONLY = {"val": "--val", "chat_template": "--chat-template"}
CHAT_ONLY = {"block_size": "--block-size", "overlong": "--overlong"}
PREFERENCE_ONLY = {"max_length": "--max-length", "truncation_mode": "--truncation-mode"}
DEFAULTS = {"overlong": "truncate", "truncation_mode": "keep_start", "format": "nanogpt",
            "text_field": "text"}


class _Parser(ArgumentParser):
    """Whole option names only (`--val` is not `--val-fraction`); a bad argument is one line, exit
    status 2 (through triax.commands.cli), as each form's own parser said it: plain tokenize's a
    DataError `triax tokenize: ... (see --help)`, --chat's and --preference's (once read) a
    UsageError `triax tokenize --chat: ... (see triax tokenize --chat --help)`."""

    def error(self, message: str):
        if self.prog != PROG:
            super().error(message)
        raise DataError(f"{self.prog}: {plain_message(message)} (see --help)")


def parser() -> _Parser:
    parser = _Parser(prog=PROG,
                     description="train a byte-level BPE (or use a tokenizer.json) and write a token "
                                 "directory for `triax train data.task=tokens`; with --chat or --preference, "
                                 "encode conversations or preference pairs with a checkpoint's tokenizer")
    parser.add_argument("inputs", nargs="+", help="text files, globs or fsspec URLs (UTF-8); with --chat or "
                                                  "--preference, local .jsonl, .json or .parquet files")
    parser.add_argument("--out", required=True, help="directory to write the token files and meta.json to")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--vocab-size", type=int, default=None, help="train a BPE with this many tokens (default 4096)")
    which.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="tail of the inputs kept for validation")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing --out")
    parser.add_argument("--workers", type=int, default=None,
                        help="use this many cores: N processes of one thread each (1: this process, one thread); "
                             "the default is this process with its tokenizer's threads on the idle cores; the same "
                             "tokens whatever the choice")
    parser.add_argument("--text-field", default=None,
                        help="the field of each .jsonl record that holds its text (default text); a record is a document")
    parser.add_argument("--format", choices=("nanogpt", "megatron"), default=None,
                        help="megatron: also write train.idx and val.idx, Megatron-LM's document index (an input "
                             "file is a document), so --out is a Megatron dataset too (default nanogpt)")
    # Once read, errors name the form, as its own parser did; --chat's wins over --preference's.
    parser.add_argument("--chat", action=FormOption, form=f"{PROG} --chat", rank=2, metavar="CHECKPOINT",
                        default=None,
                        help="chat files: render with this checkpoint's chat template (a transformers checkpoint "
                             "directory with tokenizer.json); write ids and answer masks")
    parser.add_argument("--preference", action=FormOption, form=f"{PROG} --preference", metavar="CHECKPOINT",
                        default=None,
                        help="preference pairs (prompt/chosen/rejected): write the prompt/chosen/rejected ids "
                             "TRL's DPOTrainer trains on")
    parser.add_argument("--val", default=None, help="--chat, --preference: a file of validation records (else "
                                                    "the tail of the inputs)")
    parser.add_argument("--chat-template", default=None,
                        help="--chat, --preference: a built-in template (chatml), not the checkpoint's")
    parser.add_argument("--block-size", type=int, default=None,
                        help="--chat: cut or drop longer conversations, as training")
    parser.add_argument("--overlong", choices=OVERLONG_RULES, default=None, help="--chat: (default truncate)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="--preference: leave out pairs whose prompt fills it")
    parser.add_argument("--truncation-mode", choices=TRUNCATION_MODES, default=None,
                        help="--preference: (default keep_start)")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    command = parser()
    args = command.parse_args(argv)
    if args.chat is not None:
        foreign = {**TEXT_ONLY, "preference": "--preference", **PREFERENCE_ONLY}
    elif args.preference is not None:
        foreign = {**TEXT_ONLY, **CHAT_ONLY}
    else:
        foreign = {**RECORDS_ONLY, **CHAT_ONLY, **PREFERENCE_ONLY}
    given = {option for dest, option in foreign.items() if getattr(args, dest) is not None}
    for word in argv:  # the first in the order given, as the form's own parser named it
        if word.split("=", 1)[0] in given:
            command.error(f"unrecognized arguments: {word}")
    for dest, default in DEFAULTS.items():
        setattr(args, dest, default if getattr(args, dest) is None else getattr(args, dest))
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    check_out(args.out)
    if args.chat is not None:
        return tokenize_chat(args)
    if args.preference is not None:
        return tokenize_preference(args)
    if args.workers is not None:
        if not 1 <= args.workers <= MAX_WORKERS:
            raise DataError(f"--workers must be 1 .. {MAX_WORKERS}, got {args.workers}")
        # --workers N: N cores. The workers encode with one thread each; this process's pool (training
        # a BPE, or encoding itself when N is 1) gets N, unless RAYON_NUM_THREADS says otherwise.
        os.environ.setdefault(TOKENIZER_THREADS_ENV, str(args.workers))
    apply_thread_choice(torch_threads=False)  # else the tokenizer's pool: the cores idle now (triax.runtime.threads: why)
    if not 0.0 < args.val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.vocab_size is not None and args.vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"--vocab-size must be at least {MIN_VOCAB_SIZE} (the byte alphabet), got {args.vocab_size}")
    from triax.data.tokenize_files import tokenize_text  # deferred: as the other forms

    return tokenize_text(args.inputs, args.out, vocab_size=args.vocab_size, tokenizer_file=args.tokenizer,
                         val_fraction=args.val_fraction, overwrite=args.overwrite, workers=args.workers or 1,
                         megatron=args.format == "megatron", text_field=args.text_field)


def check_out(out: str) -> None:
    """--out (a local one: fsspec URLs are the store's to refuse) follows export's rule for an output
    place: made or refused before any input is read, never a run's snapshots, kept files or own
    files; and never a run directory itself, whose tokenizer.json the token files would replace."""
    from triax.runs.output_place import check_output_place  # deferred: after --help

    if "://" in out and not out.startswith("file://"):
        return
    out = out.removeprefix("file://")
    check_output_place("--out", out)
    if os.path.isfile(os.path.join(out, "model.json")):
        raise DataError(f"--out {out!r} is a triax run directory; write the token files to a directory of their own")


def tokenize_chat(args: argparse.Namespace) -> int:
    from triax.data.tokenize_chat import OUTPUT_FILES, tokenize_chat  # deferred: the models, after --help

    check_records_arguments(args, "--chat", args.chat, OUTPUT_FILES)
    if args.block_size is not None and args.block_size < 1:
        raise DataError(f"--block-size must be 1 or more, got {args.block_size}")
    return tokenize_chat(args.chat, args.inputs, args.out, val_file=args.val, val_fraction=args.val_fraction,
                         chat_template=args.chat_template, block_size=args.block_size, overlong=args.overlong)


def tokenize_preference(args: argparse.Namespace) -> int:
    from triax.data.tokenize_preference import OUTPUT_FILES, tokenize_preference  # deferred: as tokenize_chat

    check_records_arguments(args, "--preference", args.preference, OUTPUT_FILES)
    if args.max_length is not None and args.max_length < 2:
        raise DataError(f"--max-length must be 2 or more, got {args.max_length}")
    return tokenize_preference(args.preference, args.inputs, args.out, val_file=args.val,
                               val_fraction=args.val_fraction, chat_template=args.chat_template,
                               max_length=args.max_length, truncation_mode=args.truncation_mode)


def check_records_arguments(args: argparse.Namespace, option: str, checkpoint: str, output_files: tuple) -> None:
    """The options --chat and --preference share, checked (one line each): the split, the
    checkpoint, an --out kept."""
    from triax.interop.hf import directory as hf  # deferred: with the models, after --help

    if not 0.0 < args.val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if not os.path.isdir(checkpoint) or not hf.tokenizer_file(checkpoint):
        raise DataError(f"{option} {checkpoint!r} is not a checkpoint directory with tokenizer.json")
    existing = [name for name in output_files if os.path.lexists(os.path.join(args.out, name))]
    if existing and not args.overwrite:
        raise DataError(f"--out {args.out!r} already holds {', '.join(existing)}; pass --overwrite or choose another "
                        "directory")
