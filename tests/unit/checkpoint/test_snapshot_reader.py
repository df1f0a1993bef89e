"""The one snapshot reader against broken and hostile snapshot directories: every violation is
SnapshotCorruptError, so the previous snapshot is used; nothing outside the snapshot root is read,
written or deleted. Includes a Hypothesis fuzzer (truncations, bit flips, random JSON)."""

import hashlib
import json
import os
import shutil
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triax import checkpoint


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def step(model, optimizer):
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_steps(root, steps=(4, 6)):
    """Snapshots of a tiny model at `steps`; returns {step: weights}."""
    model, optimizer = tiny_model()
    weights = {}
    for number in steps:
        step(model, optimizer)
        checkpoint.save_snapshot(str(root), number, model, optimizer, {"note": number})
        weights[number] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def load_latest(root):
    model, optimizer = tiny_model(seed=1)
    messages = []
    path, state = checkpoint.load_latest_snapshot(str(root), model, optimizer, report=messages.append)
    return state["step"], model, messages


def rewrite(snapshot, relative, data: bytes, fix_manifest=True):
    """Replace a file of a snapshot; by default also make the manifest vouch for the new bytes
    (so the reader's schema checks, not just the checksum, are what must catch it)."""
    path = os.path.join(snapshot, *relative.split("/"))
    os.remove(path) if os.path.lexists(path) else None
    with open(path, "wb") as handle:
        handle.write(data)
    if fix_manifest and relative != checkpoint.MANIFEST:
        manifest_path = os.path.join(snapshot, checkpoint.MANIFEST)
        manifest = json.load(open(manifest_path))
        manifest["files"][relative] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        open(manifest_path, "w").write(json.dumps(manifest))


def listing(path):
    return sorted((os.path.relpath(os.path.join(d, n), path), os.path.getsize(os.path.join(d, n)))
                  for d, _, names in os.walk(path) for n in names)


# ---- the README's fallback promise ---------------------------------------------------------------

BAD_JSON = {
    "manifest_list": (checkpoint.MANIFEST, b"[]"),
    "manifest_without_files": (checkpoint.MANIFEST, json.dumps({"format": "triax-snapshot/2", "step": 6,
                                                                 "world_size": 1}).encode()),
    "manifest_deeply_nested": (checkpoint.MANIFEST, b"[" * 100000 + b"]" * 100000),
    "manifest_not_json": (checkpoint.MANIFEST, b"\xff\xfe{"),
    "state_step_string": ("state.json", json.dumps({"step": "abc", "world_size": 1}).encode()),
    "state_missing_keys": ("state.json", b"{}"),
    "state_deeply_nested": ("state.json", b"{\"a\":" * 50000 + b"1" + b"}" * 50000),
    "shards_wrong_types": ("shards.json", json.dumps({"tensors": {"model/0.weight": {"dtype": "float32",
                                                      "size": "big", "chunks": []}}, "files": {}}).encode()),
    "shards_huge_tensor": ("shards.json", json.dumps({"tensors": {"model/0.weight": {
        "dtype": "float32", "size": [10**12, 10**12], "chunks": [{"offsets": [0, 0], "sizes": [10**12, 10**12],
                                                                  "file": "shards/rank_00000.bin", "offset": 0,
                                                                  "bytes": 4 * 10**24, "sha256": "0" * 64}]}},
                                                      "files": {}}).encode()),
    "rng_wrong_types": ("rng/rank_00000.json", json.dumps({"python": "x", "numpy": 1, "torch": 2}).encode()),
}


@pytest.mark.parametrize("case", list(BAD_JSON))
def test_malformed_json_means_corrupt_and_the_previous_snapshot(tmp_path, case):
    weights = save_steps(tmp_path)
    relative, data = BAD_JSON[case]
    rewrite(os.path.join(tmp_path, checkpoint.snapshot_name(6)), relative, data)
    number, model, messages = load_latest(tmp_path)
    assert number == 4 and len(messages) == 1 and "trying the previous snapshot" in messages[0]
    assert "\n" not in messages[0]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights[4].items())


@pytest.mark.parametrize("setting", [{"lr": "abc"}, {"params": [0]}, {"exec": 1}, {"betas": [0.9]}])
def test_mistyped_optimizer_settings_mean_corrupt(tmp_path, setting):
    save_steps(tmp_path)
    newest = os.path.join(tmp_path, checkpoint.snapshot_name(6))
    state = json.load(open(os.path.join(newest, "state.json")))
    state["optimizer_groups"][0].update(setting)
    rewrite(newest, "state.json", json.dumps(state).encode())
    number, _, messages = load_latest(tmp_path)
    assert number == 4 and "optimizer setting" in messages[0]


@pytest.mark.parametrize("groups", [0, 2])
def test_another_count_of_optimizer_groups_means_corrupt(tmp_path, groups):
    """A state.json the manifest vouches for, with fewer or more optimizer groups than the
    optimizer has: refused before the collective load (Hypothesis found the empty list)."""
    save_steps(tmp_path)
    newest = os.path.join(tmp_path, checkpoint.snapshot_name(6))
    state = json.load(open(os.path.join(newest, "state.json")))
    state["optimizer_groups"] = state["optimizer_groups"][:1] * groups
    rewrite(newest, "state.json", json.dumps(state).encode())
    number, _, messages = load_latest(tmp_path)
    assert number == 4 and "optimizer parameter groups" in messages[0]


@pytest.mark.parametrize("damage", ["truncate_shards", "grow_shards", "flip_shards", "truncate_state"])
def test_damaged_files_fall_back(tmp_path, damage):
    save_steps(tmp_path)
    newest = os.path.join(tmp_path, checkpoint.snapshot_name(6))
    target = os.path.join(newest, "state.json" if damage == "truncate_state" else "shards/rank_00000.bin")
    data = open(target, "rb").read()
    damaged = {"truncate_shards": data[:-5], "grow_shards": data + b"x", "truncate_state": data[:-3],
               "flip_shards": data[:7] + bytes([data[7] ^ 1]) + data[8:]}[damage]
    open(target, "wb").write(damaged)
    assert load_latest(tmp_path)[0] == 4


def test_a_fifo_in_a_snapshot_does_not_hang_the_reader(tmp_path):
    save_steps(tmp_path)
    target = os.path.join(tmp_path, checkpoint.snapshot_name(6), "shards", "rank_00000.bin")
    os.remove(target)
    os.mkfifo(target)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(load_latest(tmp_path)[0]), daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert outcome == [4], "the reader hung on a FIFO"


def test_a_non_strict_name_is_ignored_everywhere(tmp_path):
    """`step_9` beside `step_00000004`: not listed, not quarantined, not pruned, not overwritten."""
    save_steps(tmp_path, steps=(4,))
    odd = tmp_path / "step_9"
    odd.mkdir()
    (odd / "keep.txt").write_text("not triax's")
    (tmp_path / "step_notes").mkdir()
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(str(tmp_path))] == [4]
    model, optimizer = tiny_model()
    checkpoint.save_snapshot(str(tmp_path), 5, model, optimizer, {}, keep_last=1)
    checkpoint.remove_snapshots(str(tmp_path))  # trainer.overwrite=true
    assert sorted(os.listdir(tmp_path)) == ["step_9", "step_notes"]
    assert (odd / "keep.txt").read_text() == "not triax's"


def test_a_planted_staging_symlink_is_not_followed(tmp_path):
    root, elsewhere = tmp_path / "snapshots", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    os.symlink(elsewhere, root / "step_00000006.tmp")
    before = listing(elsewhere)
    model, optimizer = tiny_model()
    path = checkpoint.save_snapshot(str(root), 6, model, optimizer, {})
    assert listing(elsewhere) == before  # nothing written there, nothing deleted
    assert not os.path.islink(path) and os.path.isdir(path)
    assert os.listdir(root) == ["step_00000006"]


def test_a_symlink_at_the_final_name_is_replaced_not_followed(tmp_path):
    root, elsewhere = tmp_path / "snapshots", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    os.symlink(elsewhere, root / "step_00000006")
    model, optimizer = tiny_model()
    path = checkpoint.save_snapshot(str(root), 6, model, optimizer, {})
    assert os.path.isdir(path) and not os.path.islink(path) and listing(elsewhere) == [("precious", 1)]


def test_symlinked_snapshot_files_and_directories_are_refused(tmp_path):
    root = tmp_path / "snapshots"
    save_steps(root)
    outside = tmp_path / "outside"
    newest = root / checkpoint.snapshot_name(6)
    # A file of the newest snapshot moved outside and linked back: its bytes are right, but the
    # reader must not read through the link.
    outside.mkdir()
    shutil.move(str(newest / "shards" / "rank_00000.bin"), str(outside / "rank_00000.bin"))
    os.symlink(outside / "rank_00000.bin", newest / "shards" / "rank_00000.bin")
    # A whole snapshot directory that is a link to one elsewhere is not a candidate at all.
    shutil.copytree(root / checkpoint.snapshot_name(4), outside / "step_00000009")
    os.symlink(outside / "step_00000009", root / "step_00000009")
    assert [checkpoint.snapshot_step(s) for s in checkpoint.list_snapshots(str(root))] == [4, 6]
    number, _, messages = load_latest(root)
    assert number == 4 and "not a regular file" in messages[0]
    checkpoint.remove_snapshots(str(root))
    assert os.path.exists(outside / "step_00000009" / checkpoint.MANIFEST)  # the link's target untouched


def test_quarantine_over_a_planted_link_does_not_follow_it(tmp_path):
    root, elsewhere = tmp_path / "snapshots", tmp_path / "elsewhere"
    save_steps(root)
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    os.symlink(elsewhere, root / "step_00000006.corrupt")
    (root / "step_9").mkdir()  # a non-strict name beside them must not upset the quarantine
    rewrite(str(root / checkpoint.snapshot_name(6)), "state.json", b"[]")
    assert load_latest(root)[0] == 4
    assert (root / "step_9").is_dir()
    assert listing(elsewhere) == [("precious", 1)] and os.path.isdir(root / "step_00000006.corrupt")


# ---- the fuzzer ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    weights = save_steps(root, steps=(6,))[6]
    snapshot = os.path.join(root, checkpoint.snapshot_name(6))
    files = sorted(os.path.relpath(os.path.join(d, n), snapshot) for d, _, names in os.walk(snapshot) for n in names)
    return snapshot, files, weights


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=30)
core_keys = st.fixed_dictionaries({}, optional={
    "format": st.sampled_from(["triax-snapshot/2", "x"]), "step": st.sampled_from([6, "6", 6.0, -1]),
    "world_size": st.sampled_from([1, 0, "1", None]), "files": json_values, "optimizer_groups": json_values,
    "tensors": json_values})
documents = st.one_of(json_values, core_keys)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_snapshots_load_verified_or_are_corrupt(pristine, tmp_path_factory, data):
    source, files, weights = pristine
    work = tmp_path_factory.mktemp("fuzz")
    snapshot = os.path.join(work, checkpoint.snapshot_name(6))
    shutil.copytree(source, snapshot)
    relative = data.draw(st.sampled_from(files), label="file")
    path = os.path.join(snapshot, *relative.split("/"))
    original = open(path, "rb").read()
    kind = data.draw(st.sampled_from(["truncate", "flip", "json", "json_vouched"]), label="kind")
    if kind == "truncate":
        open(path, "wb").write(original[: data.draw(st.integers(0, max(0, len(original) - 1)), label="length")])
    elif kind == "flip":
        at = data.draw(st.integers(0, len(original) - 1), label="byte")
        bit = data.draw(st.integers(0, 7), label="bit")
        open(path, "wb").write(original[:at] + bytes([original[at] ^ (1 << bit)]) + original[at + 1:])
    else:
        target = data.draw(st.sampled_from([checkpoint.MANIFEST, "state.json", "shards.json"]), label="json file")
        document = json.dumps(data.draw(documents, label="document")).encode()
        rewrite(snapshot, target, document, fix_manifest=kind == "json_vouched")
    model, optimizer = tiny_model(seed=3)
    try:
        state = checkpoint.load_snapshot(snapshot, model, optimizer)
    except checkpoint.SnapshotCorruptError:
        return
    # The only other outcome: a verified load of exactly what was saved.
    assert state["step"] == 6
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


# ---- through the trainer -------------------------------------------------------------------------

def test_trainer_falls_back_from_mistyped_state_in_its_snapshot_dir(tmp_path, tiny_corpus, capsys):
    """state.json of the newest snapshot is consistent with its manifest but its trainer keys have
    the wrong types: one warning line, then the previous snapshot (in trainer.snapshot_dir)."""
    from support.helpers import run_snapshot_root, tiny_overrides
    from triax.config import compose_config
    from triax.train.trainer import Trainer

    extra = {"trainer.save_every": 2, "trainer.max_steps": 4, "trainer.snapshot_dir": str(tmp_path / "elsewhere")}
    overrides = tiny_overrides(tmp_path / "run", tiny_corpus, **extra)
    Trainer(compose_config(overrides)).fit()
    root = run_snapshot_root(tmp_path / "run", overrides)
    assert root == str(tmp_path / "elsewhere")
    newest = checkpoint.latest_snapshot(root)
    state = json.load(open(os.path.join(newest, "state.json")))
    rewrite(newest, "state.json", json.dumps(dict(state, epoch="abc")).encode())
    capsys.readouterr()
    resumed = Trainer(compose_config(overrides))
    err = capsys.readouterr().err
    assert resumed.step == 2 and "mistypes the trainer's keys" in err and "trying the previous snapshot" in err
