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
from typing import TYPE_CHECKING

import numpy as np

from triax import safe_files
from triax.data.chat import (ChatEncoder, EncodedSplit, chat_template_for, encode_records, read_records,
                             training_count)
from triax.data.errors import DataError
from triax.errors import printable

if TYPE_CHECKING:
    import argparse

OUTPUT_FILES = ("train.bin", "train.mask.bin", "train.starts.bin", "val.bin", "val.mask.bin", "val.starts.bin",
                "tokenizer.json", "meta.json")


def tokenize_chat(checkpoint: str, inputs: list[str], out: str, *, val_file: str | None, val_fraction: float,
                  chat_template: str | None, block_size: int | None, overlong: str) -> int:
    """Render the conversations with `checkpoint`'s chat template and write their ids, answer masks
    and starts to `out` (the arguments checked by triax.commands.tokenize)."""
    from triax.data.tokenizer import BPETokenizer  # deferred: with the models, after --help
    from triax.interop.hf import directory as hf  # deferred: with the models, after --help

    tokenizer_path = hf.tokenizer_file(checkpoint)
    tokenizer = BPETokenizer.from_file(tokenizer_path)
    template = chat_template_for(chat_template, hf.description_files(checkpoint), checkpoint)
    encoder = ChatEncoder(template, tokenizer.tokenizer)
    encoder.check_learns_to_stop()
    block = block_size if block_size is not None else 2**62

    def records(paths):
        for path in paths:
            yield from read_records(path, "input")

    train = encode_records(records(inputs), encoder, block, overlong)
    if val_file:
        val = encode_records(read_records(val_file, "--val"), encoder, block, overlong)
    else:  # the trainer's rule (triax.data.chat.load_chat_datasets)
        keep = training_count(len(train.examples), 1 - val_fraction)
        train, val = (EncodedSplit(train.examples[:keep], train.truncated, train.dropped),
                      EncodedSplit(train.examples[keep:]))
    if not train.examples or not val.examples:
        raise DataError(f"the inputs leave {len(train.examples)} training / {len(val.examples)} validation "
                        "conversations with an answer; give more conversations or change --val-fraction")
    vocab_size = len(tokenizer)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    safe_files.make_directory(out)
    counts = {}
    for name, split in (("train", train), ("val", val)):
        ids = np.fromiter((token for example in split.examples for token in example.ids), dtype=dtype)
        mask = np.fromiter((flag for example in split.examples for flag in example.mask), dtype=np.uint8)
        lengths = np.array([len(example.ids) for example in split.examples], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        safe_files.write_atomic(os.path.join(out, f"{name}.bin"), ids.tobytes())
        safe_files.write_atomic(os.path.join(out, f"{name}.mask.bin"), mask.tobytes())
        safe_files.write_atomic(os.path.join(out, f"{name}.starts.bin"), starts.tobytes())
        counts[name] = (len(split.examples), int(len(ids)), int(mask.sum()))
    safe_files.write_atomic(os.path.join(out, "tokenizer.json"), tokenizer.json_text)
    meta = {"vocab_size": vocab_size, "dtype": dtype, "tokenizer": "tokenizer.json", "chat": True,
            "train_conversations": counts["train"][0], "train_tokens": counts["train"][1],
            "train_answer_tokens": counts["train"][2], "val_conversations": counts["val"][0],
            "val_tokens": counts["val"][1], "val_answer_tokens": counts["val"][2]}
    safe_files.write_atomic(os.path.join(out, "meta.json"), json.dumps(meta, indent=1))  # last: complete
    print(printable(f"wrote {counts['train'][0]} train + {counts['val'][0]} val conversations ({counts['train'][1]} + "
                    f"{counts['val'][1]} tokens, {counts['train'][2]} + {counts['val'][2]} of them answers; "
                    f"{train.truncated + val.truncated} cut, {train.dropped + val.dropped} dropped) to {out}"))
    return 0




