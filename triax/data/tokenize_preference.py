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
from triax.data.preference import EncodedPairs, encode_pairs, identical_note, preference_encoder_for
from triax.errors import printable

OUTPUT_FILES = ("train.pairs.jsonl", "val.pairs.jsonl", "meta.json")


def tokenize_preference(checkpoint: str, inputs: list[str], out: str, *, val_file: str | None, val_fraction: float,
                        chat_template: str | None, max_length: int | None, truncation_mode: str) -> int:
    """Encode the pairs with `checkpoint`'s tokenizer (and chat template) as TRL's DPOTrainer does and
    write their ids to `out` (the arguments checked by triax.commands.tokenize)."""
    # deferred: the chat records' reader, with the models after --help
    from triax.data.chat import read_records, training_count
    from triax.data.tokenizer import BPETokenizer  # deferred: with the models, after --help
    from triax.interop.hf import directory as hf  # deferred: with the models, after --help

    tokenizer = BPETokenizer.from_file(hf.tokenizer_file(checkpoint))
    encoder = preference_encoder_for(chat_template, hf.description_files(checkpoint), checkpoint,
                                     tokenizer.tokenizer)
    limit = max_length if max_length is not None else 2**62

    def records(paths):
        for path in paths:
            yield from read_records(path, "input")

    train = encode_pairs(records(inputs), encoder, limit, truncation_mode)
    if val_file:
        val = encode_pairs(read_records(val_file, "--val"), encoder, limit, truncation_mode)
    else:  # the trainer's rule (triax.data.preference.load_preference_datasets)
        keep = training_count(len(train.pairs), 1 - val_fraction)
        train, val = EncodedPairs(train.pairs[:keep], train.truncated, train.dropped), EncodedPairs(train.pairs[keep:])
    if not train.pairs or not val.pairs:
        raise DataError(f"the inputs leave {len(train.pairs)} training / {len(val.pairs)} validation pairs; give "
                        "more pairs or change --val-fraction")
    safe_files.make_directory(out)
    for name, split in (("train", train), ("val", val)):
        lines = (json.dumps({"prompt_ids": pair.prompt, "chosen_ids": pair.chosen, "rejected_ids": pair.rejected})
                 for pair in split.pairs)
        safe_files.write_atomic(os.path.join(out, f"{name}.pairs.jsonl"), "".join(line + "\n" for line in lines))
    meta = {"preference": True, "train_pairs": len(train.pairs), "val_pairs": len(val.pairs),
            "left_out": train.dropped + val.dropped}
    safe_files.write_atomic(os.path.join(out, "meta.json"), json.dumps(meta, indent=1))  # last: complete
    print(printable(f"wrote {len(train.pairs)} train + {len(val.pairs)} val pairs ({meta['left_out']} left out: the "
                    f"prompt fills --max-length{identical_note(train.pairs + val.pairs)}) to {out}"))
    return 0
