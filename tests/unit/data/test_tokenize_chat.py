"""`triax tokenize --chat CHECKPOINT FILE --out DIR` (triax/data/tokenize_chat.py): per conversation,
the ids and the answer mask transformers' apply_chat_template gives; validation is the tail."""

import json

import numpy as np
import pytest

from support.chat_files import STYLES, style, transformers_ids_and_mask, write_chat_file  # noqa: F401  (a fixture)
from triax.data.chat import read_records, record_messages

pytest.importorskip("transformers")


def test_tokenize_chat_writes_transformers_ids_and_masks(style, tmp_path, capsys):
    """`triax tokenize --chat CHECKPOINT FILE --out DIR`: per conversation, the ids and the answer
    mask transformers' apply_chat_template gives, with where each begins; validation is the tail."""
    from triax.commands.cli import main

    name, directory, encoder, hf = style
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": STYLES[name][0], **STYLES[name][2]}))
    path = write_chat_file(tmp_path / "chat.jsonl", repeat=2)
    out = tmp_path / "tokens"
    assert main(["tokenize", "--chat", str(checkpoint), str(path), "--out", str(out), "--val-fraction", "0.2"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    expected = [transformers_ids_and_mask(hf, record_messages(record, where))
                for where, record in read_records(str(path))]
    found = []
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
        mask = np.fromfile(out / f"{split}.mask.bin", dtype=np.uint8)
        starts = list(np.fromfile(out / f"{split}.starts.bin", dtype=np.int64)) + [len(ids)]
        found += [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts, starts[1:])]
    assert meta["val_conversations"] == 2 and found == expected
    # A second run refuses to overwrite, in one line.
    capsys.readouterr()
    assert main(["tokenize", "--chat", str(checkpoint), str(path), "--out", str(out)]) != 0
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "already holds" in error
