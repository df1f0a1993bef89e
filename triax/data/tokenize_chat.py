"""`triax tokenize --chat CHECKPOINT FILE... --out DIR`: the token ids and loss masks a
`data.task=chat` run trains on, written so a user can check and reuse them.

For each split (train from the files given, val from --val FILE or the tail --val-fraction of the
conversations, as the trainer cuts them):
- `{split}.bin`: every conversation's token ids, one after the other (uint16 or uint32);
- `{split}.mask.bin`: one byte per token, 1 where the token is part of an answer (the tokens
  the loss is on: transformers' assistant mask), 0 elsewhere;
- `{split}.starts.bin`: int64, where each conversation begins in the two files above;
and meta.json ({"vocab_size", "dtype", "tokenizer", "chat": true, counts}), tokenizer.json.
Conversations longer than --block-size + 1 tokens are cut or dropped (--overlong) as in training.
"""

from __future__ import annotations

import json
import os

import numpy as np

from triax import safe_files
from triax.data.chat import (OVERLONG_RULES, ChatEncoder, EncodedSplit, chat_template_for, encode_records, read_records,
                             training_count)
from triax.data.errors import DataError
from triax.errors import printable

OUTPUT_FILES = ("train.bin", "train.mask.bin", "train.starts.bin", "val.bin", "val.mask.bin", "val.starts.bin",
                "tokenizer.json", "meta.json")


def main(argv: list[str]) -> int:
    from triax.arguments import ArgumentParser  # deferred: with the models' imports below, after --help
    from triax.data.tokenizer import BPETokenizer  # deferred: with the models, after --help
    from triax.interop.hf import directory as hf  # deferred: with the models, after --help

    parser = ArgumentParser(prog="triax tokenize --chat",
                     description="render chat files with a checkpoint's chat template and write the token ids and "
                                 "answer masks a data.task=chat run trains on")
    parser.add_argument("--chat", required=True, metavar="CHECKPOINT",
                        help="a transformers checkpoint directory with tokenizer.json and a chat template")
    add_split_arguments(parser, "conversations", "directory to write the token, mask and start files to")
    parser.add_argument("--block-size", type=int, default=None, help="cut or drop longer conversations, as training")
    parser.add_argument("--overlong", choices=OVERLONG_RULES, default="truncate")
    args = parser.parse_args(argv)
    check_split_arguments(args, "--chat", args.chat, OUTPUT_FILES)
    if args.block_size is not None and args.block_size < 1:
        raise DataError(f"--block-size must be 1 or more, got {args.block_size}")
    tokenizer_path = hf.tokenizer_file(args.chat)
    tokenizer = BPETokenizer.from_file(tokenizer_path)
    template = chat_template_for(args.chat_template, hf.description_files(args.chat), args.chat)
    encoder = ChatEncoder(template, tokenizer.tokenizer)
    encoder.check_learns_to_stop()
    block = args.block_size if args.block_size is not None else 2**62

    def records(paths):
        for path in paths:
            yield from read_records(path, "input")

    train = encode_records(records(args.inputs), encoder, block, args.overlong)
    if args.val:
        val = encode_records(read_records(args.val, "--val"), encoder, block, args.overlong)
    else:  # the trainer's rule (triax.data.chat.load_chat_datasets)
        keep = training_count(len(train.examples), 1 - args.val_fraction)
        train, val = (EncodedSplit(train.examples[:keep], train.truncated, train.dropped),
                      EncodedSplit(train.examples[keep:]))
    if not train.examples or not val.examples:
        raise DataError(f"the inputs leave {len(train.examples)} training / {len(val.examples)} validation "
                        "conversations with an answer; give more conversations or change --val-fraction")
    vocab_size = len(tokenizer)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    safe_files.make_directory(args.out)
    counts = {}
    for name, split in (("train", train), ("val", val)):
        ids = np.fromiter((token for example in split.examples for token in example.ids), dtype=dtype)
        mask = np.fromiter((flag for example in split.examples for flag in example.mask), dtype=np.uint8)
        lengths = np.array([len(example.ids) for example in split.examples], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        safe_files.write_atomic(os.path.join(args.out, f"{name}.bin"), ids.tobytes())
        safe_files.write_atomic(os.path.join(args.out, f"{name}.mask.bin"), mask.tobytes())
        safe_files.write_atomic(os.path.join(args.out, f"{name}.starts.bin"), starts.tobytes())
        counts[name] = (len(split.examples), int(len(ids)), int(mask.sum()))
    safe_files.write_atomic(os.path.join(args.out, "tokenizer.json"), tokenizer.json_text)
    meta = {"vocab_size": vocab_size, "dtype": dtype, "tokenizer": "tokenizer.json", "chat": True,
            "train_conversations": counts["train"][0], "train_tokens": counts["train"][1],
            "train_answer_tokens": counts["train"][2], "val_conversations": counts["val"][0],
            "val_tokens": counts["val"][1], "val_answer_tokens": counts["val"][2]}
    safe_files.write_atomic(os.path.join(args.out, "meta.json"), json.dumps(meta, indent=1))  # last: complete
    print(printable(f"wrote {counts['train'][0]} train + {counts['val'][0]} val conversations ({counts['train'][1]} + "
                    f"{counts['val'][1]} tokens, {counts['train'][2]} + {counts['val'][2]} of them answers; "
                    f"{train.truncated + val.truncated} cut, {train.dropped + val.dropped} dropped) to {args.out}"))
    return 0


def add_split_arguments(parser, records: str, out_help: str) -> None:
    """The options `triax tokenize --chat` and `--preference` share: the record files, where to
    write, the validation split and the template."""
    parser.add_argument("inputs", nargs="+", help=f"local .jsonl, .json or .parquet files of {records}")
    parser.add_argument("--out", required=True, help=out_help)
    parser.add_argument("--val", default=None, help=f"a file of validation {records} (else the tail of the inputs)")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--chat-template", default=None, help="a built-in template (chatml), not the checkpoint's")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing --out")


def check_split_arguments(args, option: str, checkpoint: str, output_files: tuple) -> None:
    """The shared options' checks (one line each): the split, the checkpoint, an --out kept."""
    from triax.interop.hf import directory as hf  # deferred: with the models, after --help

    if not 0.0 < args.val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if not os.path.isdir(checkpoint) or not hf.tokenizer_file(checkpoint):
        raise DataError(f"{option} {checkpoint!r} is not a checkpoint directory with tokenizer.json")
    existing = [name for name in output_files if os.path.lexists(os.path.join(args.out, name))]
    if existing and not args.overwrite:
        raise DataError(f"--out {args.out!r} already holds {', '.join(existing)}; pass --overwrite or choose another "
                        "directory")
