"""`triax tokenize --preference CHECKPOINT FILE... --out DIR`: the token ids a data.task=preference
run trains on, written so a user can check them against TRL's DPOTrainer.

For each split (train from the files given, val from --val FILE or the tail --val-fraction of the
pairs, as the trainer cuts them), `{split}.pairs.jsonl`: one line a pair,
{"prompt_ids": [...], "chosen_ids": [...], "rejected_ids": [...]}: TRL's names, and its values
before max_length cuts a sequence (pairs whose prompt fills --max-length are left out, as TRL's
keep_start leaves them out); and meta.json with the counts.
"""

from __future__ import annotations

import json
import os

from triax import safe_files
from triax.data.errors import DataError
from triax.data.preference import TRUNCATION_MODES, EncodedPairs, encode_pairs, preference_encoder_for
from triax.data.tokenize_chat import add_split_arguments, check_split_arguments
from triax.errors import printable

OUTPUT_FILES = ("train.pairs.jsonl", "val.pairs.jsonl", "meta.json")


def main(argv: list[str]) -> int:
    from triax.arguments import ArgumentParser  # deferred: with the models' imports below, after --help
    from triax.data.chat import read_records, training_count
    from triax.data.tokenizer import BPETokenizer  # deferred: with the models, after --help
    from triax.interop.hf import directory as hf  # deferred: with the models, after --help

    parser = ArgumentParser(prog="triax tokenize --preference",
                            description="encode preference pairs with a checkpoint's tokenizer and chat template "
                                        "as TRL's DPOTrainer does, and write their ids")
    parser.add_argument("--preference", required=True, metavar="CHECKPOINT",
                        help="a transformers checkpoint directory with tokenizer.json (and a chat template for "
                             "conversational records)")
    add_split_arguments(parser, "pairs (prompt/chosen/rejected)", "directory to write the pair files to")
    parser.add_argument("--max-length", type=int, default=None, help="leave out pairs whose prompt fills it")
    parser.add_argument("--truncation-mode", choices=TRUNCATION_MODES, default="keep_start")
    args = parser.parse_args(argv)
    check_split_arguments(args, "--preference", args.preference, OUTPUT_FILES)
    if args.max_length is not None and args.max_length < 2:
        raise DataError(f"--max-length must be 2 or more, got {args.max_length}")
    tokenizer = BPETokenizer.from_file(hf.tokenizer_file(args.preference))
    encoder = preference_encoder_for(args.chat_template, hf.description_files(args.preference), args.preference,
                                     tokenizer.tokenizer)
    limit = args.max_length if args.max_length is not None else 2**62

    def records(paths):
        for path in paths:
            yield from read_records(path, "input")

    train = encode_pairs(records(args.inputs), encoder, limit, args.truncation_mode)
    if args.val:
        val = encode_pairs(read_records(args.val, "--val"), encoder, limit, args.truncation_mode)
    else:  # the trainer's rule (triax.data.preference.load_preference_datasets)
        keep = training_count(len(train.pairs), 1 - args.val_fraction)
        train, val = EncodedPairs(train.pairs[:keep], train.truncated, train.dropped), EncodedPairs(train.pairs[keep:])
    if not train.pairs or not val.pairs:
        raise DataError(f"the inputs leave {len(train.pairs)} training / {len(val.pairs)} validation pairs; give "
                        "more pairs or change --val-fraction")
    safe_files.make_directory(args.out)
    for name, split in (("train", train), ("val", val)):
        lines = (json.dumps({"prompt_ids": pair.prompt, "chosen_ids": pair.chosen, "rejected_ids": pair.rejected})
                 for pair in split.pairs)
        safe_files.write_atomic(os.path.join(args.out, f"{name}.pairs.jsonl"), "".join(line + "\n" for line in lines))
    meta = {"preference": True, "train_pairs": len(train.pairs), "val_pairs": len(val.pairs),
            "left_out": train.dropped + val.dropped}
    safe_files.write_atomic(os.path.join(args.out, "meta.json"), json.dumps(meta, indent=1))  # last: complete
    print(printable(f"wrote {len(train.pairs)} train + {len(val.pairs)} val pairs ({meta['left_out']} left out: the "
                    f"prompt fills --max-length) to {args.out}"))
    return 0
