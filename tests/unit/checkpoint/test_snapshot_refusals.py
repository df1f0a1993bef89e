"""A snapshot whose files were edited and re-signed: numbers out of range fall back to the previous
snapshot, chunks that share or overlap bytes are refused before anything is allocated, and a step
quarantined twice keeps both copies."""

import os

import pytest


def _resign(snapshot, relative, text):
    import hashlib
    import json

    data = text.encode()
    with open(os.path.join(snapshot, relative), "wb") as handle:
        handle.write(data)
    manifest_path = os.path.join(snapshot, "manifest.json")
    manifest = json.load(open(manifest_path))
    manifest["files"][relative] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    open(manifest_path, "w").write(json.dumps(manifest))


def _two_snapshots(root):
    import torch

    from triax import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    schedule = {"base_lrs": [0.01], "last_epoch": 3}
    good = checkpoint.save_snapshot(str(root), 3, model, optimizer, {"scheduler": schedule})
    newest = checkpoint.save_snapshot(str(root), 4, model, optimizer, {"scheduler": schedule})
    return model, optimizer, good, newest


STATE_EDITS = {
    "NaN learning rates": lambda text: text.replace('"base_lrs": [\n   0.01\n  ]', '"base_lrs": [NaN]'),
    "infinite beta": lambda text: text.replace('"betas": [\n    0.9,', '"betas": [\n    Infinity,'),
    "overflowing beta": lambda text: text.replace('"betas": [\n    0.9,', '"betas": [\n    1e999,'),
    "beta of 2": lambda text: text.replace('"betas": [\n    0.9,', '"betas": [\n    2.0,'),
    "negative eps": lambda text: text.replace('"eps": 1e-08', '"eps": -1e-08'),
    "position of 2^61": lambda text: text.replace('"last_epoch": 3', f'"last_epoch": {2**61}'),
}


@pytest.mark.parametrize("name", list(STATE_EDITS))
def test_a_resigned_state_with_numbers_out_of_range_falls_back(name, tmp_path):
    from triax import checkpoint

    model, optimizer, good, newest = _two_snapshots(tmp_path)
    text = open(os.path.join(newest, "state.json")).read()
    edited = STATE_EDITS[name](text)
    assert edited != text, "the edit did not apply"
    _resign(newest, "state.json", edited)
    messages = []
    path, state = checkpoint.load_latest_snapshot(str(tmp_path), model, optimizer, report=messages.append)
    assert path == good and state["step"] == 3, messages
    assert all(group["lr"] == 0.01 and list(group["betas"]) == [0.9, 0.999] and group["eps"] == 1e-8
               for group in optimizer.param_groups)


def _shards_edit(snapshot, edit):
    import json

    shards = json.load(open(os.path.join(snapshot, "shards.json")))
    edit(shards["tensors"])
    _resign(snapshot, "shards.json", json.dumps(shards))


def _repeat_chunk(tensors, copies):
    """One tensor made of `copies` chunks that all name the same bytes of the file."""
    entry = tensors["model/weight"]
    chunk = entry["chunks"][0]
    rows = chunk["sizes"][0]
    entry["size"] = [rows * copies, *entry["size"][1:]]
    entry["chunks"] = [dict(chunk, offsets=[rows * i, *chunk["offsets"][1:]]) for i in range(copies)]


def test_chunks_sharing_file_bytes_are_refused(tmp_path):
    from triax import checkpoint

    _, _, good, newest = _two_snapshots(tmp_path)
    _shards_edit(newest, lambda tensors: _repeat_chunk(tensors, 256))
    with pytest.raises(checkpoint.SnapshotCorruptError, match="share bytes"):
        checkpoint.open_snapshot(newest)


def test_twenty_thousand_overlapping_chunks_are_refused_quickly(tmp_path):
    """The overlap check is O(n log n): 20,000 chunks on one spot end in a refusal, not a hang."""
    from triax import checkpoint

    _, _, good, newest = _two_snapshots(tmp_path)

    def pile(tensors):
        entry = tensors["model/weight"]
        chunk = entry["chunks"][0]
        entry["size"] = [20000 * chunk["sizes"][0], *entry["size"][1:]]
        # all at offset 0: the volumes add up but every chunk covers the same first rows
        entry["chunks"] = [dict(chunk) for _ in range(20000)]

    _shards_edit(newest, pile)
    with pytest.raises(checkpoint.SnapshotCorruptError, match="overlap|share bytes"):
        checkpoint.open_snapshot(newest)


def test_requarantining_a_step_keeps_the_earlier_copy(tmp_path):
    from triax import checkpoint

    model, optimizer, _, newest = _two_snapshots(tmp_path)
    first = checkpoint.quarantine_snapshot(newest)
    second_write = checkpoint.save_snapshot(str(tmp_path), 4, model, optimizer, {})
    second = checkpoint.quarantine_snapshot(second_write)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    checkpoint.remove_snapshots(str(tmp_path))  # trainer.overwrite=true clears every copy
    assert os.listdir(tmp_path) == []
