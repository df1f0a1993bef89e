"""Token directories in nanoGPT's layout (train.bin / val.bin): training, exact resume, 2 processes
equal 1, remote (memory://) directories read by range, and one clear line for every bad directory."""

import json
import os
import shutil

import fsspec
import numpy as np
import pytest
import torch

from triax import checkpoint
from triax.commands.cli import main as triax_main
from triax.data.tokens import load_token_datasets
from triax.config import compose_config
from triax.train.trainer import Trainer

from support.helpers import assert_same_training, final_weights, tiny_overrides, train

VOCAB = 61


def token_ids(count, seed):
    """A learnable stream: a fixed random 'sentence' of 97 ids repeated, with some noise."""
    rng = np.random.default_rng(seed)
    ids = np.tile(np.random.default_rng(0).integers(0, VOCAB, 97), count // 97 + 1)[:count]
    noise = rng.random(count) < 0.05
    ids[noise] = rng.integers(0, VOCAB, noise.sum())
    return ids.astype(np.uint16)


@pytest.fixture
def token_dir(tmp_path):
    """nanoGPT's layout as its prepare.py leaves it: uint16 train.bin / val.bin and a meta.pkl."""
    directory = tmp_path / "tokens"
    directory.mkdir()
    token_ids(6000, 1).tofile(directory / "train.bin")
    token_ids(700, 2).tofile(directory / "val.bin")
    (directory / "meta.pkl").write_bytes(b"\x80\x04 not to be unpickled")
    return directory


def token_overrides(run_dir, directory, **extra):
    values = {"data.task": "tokens", "data.vocab_size": VOCAB, "model.dropout": 0.1, **extra}
    return tiny_overrides(run_dir, str(directory), **values)


def run_trainer(overrides):
    trainer = Trainer(compose_config(overrides))
    trainer.fit()
    return trainer


def test_nanogpt_layout_trains_and_resumes_exactly(tmp_path, token_dir):
    overrides = token_overrides(tmp_path / "run", token_dir, **{
        "trainer.max_steps": 20, "trainer.save_every": 10, "trainer.log_every": 5, "optim.lr": 0.01})
    first = run_trainer(overrides)
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert losses[-1] < losses[0] - 0.5, losses  # it learns the repeated sequence
    expected = final_weights(tmp_path / "run")
    # Drop the final snapshot: the next run resumes at step 10, mid-epoch, and must replay steps
    # 11-20 bitwise (same windows in the same order, same dropout masks).
    shutil.rmtree(first.last_snapshot)
    resumed = Trainer(compose_config(overrides))
    assert (resumed.step, resumed.epoch, resumed.sample_index) == (10, 0, 80)
    resumed.fit()
    replayed = final_weights(tmp_path / "run")
    assert all(torch.equal(replayed[name], expected[name]) for name in expected)


@pytest.mark.multiprocess
def test_two_processes_equal_one_on_token_files(tmp_path, token_dir):
    # No biases: the key projection's bias has a zero true gradient, and Adam turns its round-off
    # into steps of size lr, so it would differ between layouts by chance (not by a bug).
    same = {"model.dropout": 0.0, "model.bias": "false"}
    train(token_overrides(tmp_path / "ddp", token_dir, **{"trainer.batch_size": 4, **same}), nproc=2)
    train(token_overrides(tmp_path / "single", token_dir, **{"trainer.batch_size": 8, **same}))
    assert_same_training(tmp_path / "ddp", tmp_path / "single")


def test_memory_url_directory_reads_by_range_and_equals_local(tmp_path, token_dir):
    """A remote directory (memory://, read window by window) trains to the same weights as the
    memory-mapped local copy; its tokenizer travels into the run directory."""
    url = f"memory://triax-tokens-{os.getpid()}-{tmp_path.name}"
    fs = fsspec.filesystem("memory")
    for name in ("train.bin", "val.bin"):
        fs.pipe(f"{url}/{name}", (token_dir / name).read_bytes())
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install 'triax[tokenize]')")
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    fs.pipe(f"{url}/tokenizer.json", Tokenizer(models.WordLevel(vocab, unk_token="t0")).to_str().encode())
    fs.pipe(f"{url}/meta.json", json.dumps({"vocab_size": VOCAB, "dtype": "uint16",
                                            "tokenizer": "tokenizer.json"}).encode())
    train_set, _, vocab_size, tokenizer = load_token_datasets(url, 16)
    assert train_set.tokens._array is None and vocab_size == VOCAB and tokenizer.endswith("tokenizer.json")
    remote = run_trainer(tiny_overrides(tmp_path / "remote", url, **{"data.task": "tokens"}))
    local = run_trainer(tiny_overrides(tmp_path / "local", str(token_dir),
                                       **{"data.task": "tokens", "data.vocab_size": VOCAB}))
    assert remote.data.train.tokens._array is None and local.data.train.tokens._array is not None
    a, b = final_weights(tmp_path / "remote"), final_weights(tmp_path / "local")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert (tmp_path / "remote" / "tokenizer.json").read_bytes() == fs.cat(f"{url}/tokenizer.json")


def test_windows_are_block_size_plus_one_tokens(token_dir):
    train_set, val_set, _, _ = load_token_datasets(str(token_dir), 16, vocab_size=VOCAB)
    ids = np.fromfile(token_dir / "train.bin", dtype=np.uint16)
    assert len(train_set) == len(ids) - 16 and len(val_set) == 700 - 16
    x, y = train_set.batch(torch.tensor([0, len(train_set) - 1]))
    assert x.shape == (2, 16) and x.dtype == torch.int64
    assert torch.equal(x[1], torch.from_numpy(ids[-17:-1].astype(np.int64)))
    assert torch.equal(y[1], torch.from_numpy(ids[-16:].astype(np.int64)))


def test_an_out_of_range_id_anywhere_is_caught_when_its_window_is_read(tmp_path, token_dir):
    ids = np.fromfile(token_dir / "train.bin", dtype=np.uint16)
    ids[3000] = 65535
    ids.tofile(token_dir / "train.bin")
    train_set, _, _, _ = load_token_datasets(str(token_dir), 16, vocab_size=VOCAB)  # the sample misses it
    train_set.batch(torch.tensor([0, 2983]))
    with pytest.raises(ValueError, match=r"token id 65535 .*\(window at token 2990\)"):
        train_set.batch(torch.tensor([5, 2990]))


def bad_directory(tmp_path, token_dir, case):
    """Break a copy of the token directory in one way; returns (extra overrides, words the error needs)."""
    directory = tmp_path / "bad"
    shutil.copytree(token_dir, directory)
    if case == "missing val.bin":
        (directory / "val.bin").unlink()
        return {}, ["val.bin"]
    if case == "odd size":
        with open(directory / "train.bin", "ab") as handle:
            handle.write(b"\x01")
        return {}, ["train.bin", "12001 bytes", "uint16"]
    if case == "id out of range":
        ids = np.fromfile(directory / "train.bin", dtype=np.uint16)
        ids[-1] = VOCAB + 5  # the last window is among those checked when the file is opened
        ids.tofile(directory / "train.bin")
        return {}, ["token id 66", "train.bin", f"[0, {VOCAB})"]
    if case == "too short":
        token_ids(10, 3).tofile(directory / "val.bin")
        return {}, ["val.bin", "10 tokens", "17"]
    if case == "only meta.pkl":
        return {"data.vocab_size": "null"}, ["meta.pkl", "pickle", "data.vocab_size"]
    if case == "bad meta.json":
        (directory / "meta.json").write_text('{"vocab_size": "many"}')
        return {"data.vocab_size": "null"}, ["meta.json", "vocab_size", "many"]
    if case == "vocab too small":
        (directory / "meta.json").write_text(json.dumps({"vocab_size": VOCAB}))
        return {"data.vocab_size": 10}, ["data.vocab_size=10", str(VOCAB)]
    if case == "not a directory":
        return {"data.path": str(directory / "train.bin")}, ["is a file", "directory"]
    if case == "bad dtype":
        return {"data.token_dtype": "float32"}, ["data.token_dtype", "float32"]
    raise AssertionError(case)


BAD_CASES = ["missing val.bin", "odd size", "id out of range", "too short", "only meta.pkl", "bad meta.json",
             "vocab too small", "not a directory", "bad dtype"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_token_directory_gives_one_clear_line(tmp_path, token_dir, capsys, case):
    extra, words = bad_directory(tmp_path, token_dir, case)
    run_dir = tmp_path / "run"
    overrides = token_overrides(run_dir, tmp_path / "bad", **extra)
    assert triax_main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("triax: error:"), err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"
    assert not run_dir.exists(), "a failed start left a run directory behind"
