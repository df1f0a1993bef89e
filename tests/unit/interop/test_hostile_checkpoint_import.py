"""Hostile and careless transformers checkpoints, on every command that reads one:
`triax train model.init_from=DIR`, `triax eval DIR` and `triax export RUN --format hf`.

Each damaged checkpoint is a copy of a real one (saved by transformers, tests/support/llama_checkpoints.py)
with one thing wrong: a safetensors file the safetensors library cannot read, a config.json whose
fields have the wrong JSON type or describe another model, a shard index that lies, a link out of
the directory, a FIFO, a tokenizer that makes the Rust library panic. The only allowed outcome is
one line and exit code 2, nothing written anywhere (the sandbox of support/sandbox.py lists the
whole tree before and after), no hang, and nothing allocated before the sizes are checked.
"""

import json
import os
import shutil
import signal

import pytest
import torch

from support.llama_checkpoints import hf_model, save_checkpoint
from support.sandbox import sandbox  # noqa: F401  (the fixture)
from triax.commands.cli import main as triax_main

from support.helpers import tiny_overrides

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")


@pytest.fixture(autouse=True)
def no_hang():
    """A case that blocks (a FIFO opened for reading) fails after a minute instead of hanging the suite."""
    def hung(*_):
        raise TimeoutError("the command blocked: a case must end at once")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def original(tmp_path_factory, tiny_corpus):
    """A tiny Llama save_pretrained directory with its tokenizer.json."""
    directory = tmp_path_factory.mktemp("llama")
    save_checkpoint(directory, "llama", tiny_corpus)
    return directory


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_corpus):
    """The same model saved in several safetensors shards with an index."""
    directory = tmp_path_factory.mktemp("llama-sharded")
    hf_model("llama").save_pretrained(directory, max_shard_size="20KB")
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    return directory


@pytest.fixture
def checkpoint(original, sandbox):  # noqa: F811
    return shutil.copytree(original, sandbox.work / "ckpt")


@pytest.fixture
def shards(sharded, sandbox):  # noqa: F811
    return shutil.copytree(sharded, sandbox.work / "ckpt")


@pytest.fixture
def outside(sandbox):  # noqa: F811
    """A directory beside the checkpoint, holding files a link might point at."""
    path = sandbox.work / "elsewhere"
    path.mkdir()
    return path


def commands(directory, corpus, run_dir):
    """Both readers of a checkpoint: fine-tuning from it, and scoring it."""
    return {"train": ["train", *tiny_overrides(run_dir, corpus, **{"model.init_from": str(directory)})],
            "eval": ["eval", str(directory), "--text", str(corpus)]}


def refused_by_both(sandbox, directory, corpus, *words):  # noqa: F811
    for argv in commands(directory, corpus, sandbox.work / "run").values():
        sandbox.refused(argv, *words)
    assert not (sandbox.work / "run").exists()


# ---- safetensors files the library cannot read --------------------------------------------------

def read_safetensors(path):
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_safetensors(path, header, data):
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def edit_header(path, change):
    header, data = read_safetensors(path)
    change({name: entry for name, entry in header.items() if name != "__metadata__"})
    write_safetensors(path, header, data)


def by_offset(entries):
    return sorted(entries.values(), key=lambda entry: entry["data_offsets"][0])


def _past_the_end(entries):
    last = by_offset(entries)[-1]
    size = last["data_offsets"][1] - last["data_offsets"][0]
    last["data_offsets"] = [last["data_offsets"][0] + size, last["data_offsets"][1] + size]


def _overlapping(entries):
    first, second = entries["model.layers.0.self_attn.q_proj.weight"], entries["model.layers.1.self_attn.q_proj.weight"]
    second["data_offsets"] = list(first["data_offsets"])


def _as(dtype):
    def change(entries):
        entries["model.layers.0.mlp.up_proj.weight"]["dtype"] = dtype
    return change


def _overflowing_shape(entries):
    entries["model.norm.weight"]["shape"] = [2**32, 2**32, 2**32]


def _negative_shape(entries):
    entries["model.norm.weight"]["shape"] = [-32]


def _replace_file(content):
    def damage(path):
        path.write_bytes(content)
    return damage


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _huge_header_length(path):
    raw = path.read_bytes()
    path.write_bytes((2**62).to_bytes(8, "little") + raw[8:])


def _header_not_json(path):
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    path.write_bytes(raw[:8] + b"\xff" * length + raw[8 + length:])


def _header_a_list(path):
    _, data = read_safetensors(path)
    encoded = b"[1, 2, 3]"
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def _metadata_not_strings(path):
    header, data = read_safetensors(path)
    header["__metadata__"] = {"format": ["pt"]}
    write_safetensors(path, header, data)


def _pickle(path):
    torch.save({"weight": torch.ones(4)}, path)  # what torch.save writes (a zip of pickles): never unpickled


SAFETENSORS_CASES = {
    # name: (damage to model.safetensors, words the line must contain)
    "offsets past the end": (lambda p: edit_header(p, _past_the_end), ["model.safetensors", "byte"]),
    "overlapping offsets": (lambda p: edit_header(p, _overlapping), ["overlap"]),
    "dtype that does not fit the bytes": (lambda p: edit_header(p, _as("F16")), ["up_proj", "F16", "bytes"]),
    "unknown dtype": (lambda p: edit_header(p, _as("Q4")), ["dtype 'Q4'"]),
    "shape whose product overflows": (lambda p: edit_header(p, _overflowing_shape), ["model.norm.weight", "bytes"]),
    "negative shape": (lambda p: edit_header(p, _negative_shape), ["model.norm.weight", "shape"]),
    "huge header length": (_huge_header_length, ["header of 4611686018427387904 bytes"]),
    "truncated file": (_truncate, ["truncated"]),
    "header not UTF-8 JSON": (_header_not_json, ["not UTF-8 JSON"]),
    "header a list": (_header_a_list, ["not an object"]),
    "shorter than a header": (_replace_file(b"abc"), ["shorter than a safetensors header"]),
    "metadata not strings": (_metadata_not_strings, ["__metadata__"]),
    "a pickle saved as model.safetensors": (_pickle, ["not a safetensors file"]),
    # A weight stored as integers (the bytes of an I32 tensor are as long as an F32's): converted
    # to float it would train a model far from any weights (a loss of 1e10).
    "integer weights": (lambda p: edit_header(p, _as("I32")), ["up_proj", "I32", "not a floating type"]),
}


@pytest.mark.parametrize("name", list(SAFETENSORS_CASES))
def test_a_damaged_safetensors_file_is_one_line(name, sandbox, checkpoint, tiny_corpus):  # noqa: F811
    damage, words = SAFETENSORS_CASES[name]
    damage(checkpoint / "model.safetensors")
    refused_by_both(sandbox, checkpoint, tiny_corpus, *words)


@pytest.mark.parametrize("kind", ["link to /dev/zero", "FIFO", "directory", "link outside"])
def test_a_weights_file_that_is_not_a_file_of_the_checkpoint_is_refused_at_once(kind, sandbox, checkpoint, outside,
                                                                                tiny_corpus):
    weights = checkpoint / "model.safetensors"
    if kind == "link outside":  # a real checkpoint's weights, elsewhere: still not read
        shutil.move(weights, outside / "model.safetensors")
    weights.unlink(missing_ok=True)
    if kind == "link to /dev/zero":
        weights.symlink_to("/dev/zero")
    elif kind == "FIFO":
        os.mkfifo(weights)
    elif kind == "directory":
        weights.mkdir()
    else:
        weights.symlink_to(outside / "model.safetensors")
    words = ["outside the checkpoint directory"] if kind.startswith("link") else ["not a regular file"]
    refused_by_both(sandbox, checkpoint, tiny_corpus, "model.safetensors", *words)


# ---- a sharded checkpoint's index ---------------------------------------------------------------

def _index(directory):
    return json.loads((directory / "model.safetensors.index.json").read_text())


def _write_index(directory, content):
    (directory / "model.safetensors.index.json").write_text(json.dumps(content))


def _wrong_shard(directory):
    index = _index(directory)
    weight_map = index["weight_map"]
    name = "model.norm.weight"
    weight_map[name] = next(file for file in sorted(set(weight_map.values())) if file != weight_map[name])
    _write_index(directory, index)


def _shard(directory, position=0):
    return directory / sorted(set(_index(directory)["weight_map"].values()))[position]


def _fifo_shard(directory):
    shard = _shard(directory)
    shard.unlink()
    os.mkfifo(shard)


def _shard_linked_outside(directory):
    shard = _shard(directory)
    target = directory.parent / "elsewhere" / shard.name
    shutil.move(shard, target)
    shard.symlink_to(os.path.abspath(target))


INDEX_CASES = {
    "index a list": (lambda d: _write_index(d, [1, 2]), ["no weight_map"]),
    "weight_map a list": (lambda d: _write_index(d, {"weight_map": ["a"]}), ["no weight_map"]),
    "index not JSON": (lambda d: (d / "model.safetensors.index.json").write_bytes(b"{\xff"), ["cannot read"]),
    "a shard outside the directory": (lambda d: _write_index(d, {"weight_map": {"model.norm.weight": "../x"}}),
                                      ["'../x'", "files of the checkpoint directory"]),
    "the wrong shard for a tensor": (_wrong_shard, ["model.norm.weight", "does not hold it"]),
    "a missing shard": (lambda d: _shard(d).unlink(), ["does not exist"]),
    "a FIFO shard": (_fifo_shard, ["not a regular file"]),
    "a shard linked outside": (_shard_linked_outside, ["outside the checkpoint directory"]),
}


@pytest.mark.parametrize("name", list(INDEX_CASES))
def test_a_bad_shard_index_is_one_line(name, sandbox, shards, outside, tiny_corpus):  # noqa: F811
    damage, words = INDEX_CASES[name]
    tokens = tokens_dir(sandbox.root.parent / "tokens")
    damage(shards)
    # The sharded checkpoint has no tokenizer: train on, and score, token ids.
    sandbox.refused(["train", *tiny_overrides(sandbox.work / "run", tiny_corpus, **{
        "model.init_from": str(shards), "data.task": "tokens", "data.path": str(tokens)})], *words)
    sandbox.refused(["eval", str(shards), "--tokens", str(tokens / "val.bin")], *words)


def tokens_dir(path):
    """A token directory (nanoGPT's layout) of ids below the checkpoint's vocabulary."""
    import numpy

    path.mkdir()
    ids = numpy.arange(4000, dtype=numpy.uint16) % 300
    ids.tofile(path / "train.bin")
    ids[:1000].tofile(path / "val.bin")
    (path / "meta.json").write_text(json.dumps({"vocab_size": 301, "dtype": "uint16"}))
    return path


# ---- config.json: the types transformers gives its fields, and a model its weights hold --------

def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


CONFIG_CASES = {
    "model_type a list": (dict(model_type=["llama"]), ["model_type=['llama'] is a JSON array", "a string"]),
    # bool("false") is True: the run would tie its head and drop the checkpoint's lm_head
    "tie_word_embeddings a string": (dict(tie_word_embeddings="false"), ["tie_word_embeddings='false'", "true or false"]),
    "rope_theta a string": (dict(rope_theta="inf"), ["rope_theta='inf' is a JSON string"]),
    "vocab_size a boolean": (dict(vocab_size=True), ["vocab_size=True is a JSON boolean", "an integer"]),
    "hidden_size a float": (dict(hidden_size=32.0), ["hidden_size=32.0", "an integer"]),
    "rope factor a string": (dict(rope_scaling={"rope_type": "linear", "factor": "8"}), ["rope_scaling.factor='8'"]),
    "eos_token_id a string": (dict(eos_token_id="2"), ["eos_token_id='2'"]),
    # ~300M parameters over the tiny checkpoint's weights: refused from the headers, nothing built
    "a larger model than its weights": (dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                             num_attention_heads=16, num_key_value_heads=16, head_dim=64),
                                        ["has shape", "do not belong to this config"]),
}


@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_a_mistyped_or_mismatched_config_is_one_line_before_anything_is_allocated(name, sandbox, checkpoint,  # noqa: F811
                                                                                  tiny_corpus, monkeypatch):
    changes, words = CONFIG_CASES[name]
    edit_config(checkpoint, **changes)
    forbid_allocation(monkeypatch)
    refused_by_both(sandbox, checkpoint, tiny_corpus, "config.json", *words)


def forbid_allocation(monkeypatch):
    """Materialising a model (to_empty: every builder allocates through it) fails the test."""
    def allocated(*_, **__):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(torch.nn.Module, "to_empty", allocated)


@pytest.mark.parametrize("content,words", [
    (b'{"model_type": "llama", "rope_theta": 1e999}', ["rope_theta=inf", "not finite"]),
    (b"[1, 2]", ["holds a JSON list"]),
    (b'{"model_type": "llama", "a": NaN}', ["NaN"]),
    (b'{"model_type": "llama\xff"}', ["UnicodeDecodeError"]),  # not UTF-8
    (b"[" * 100_000 + b"]" * 100_000, ["RecursionError"]),  # nested past any real config
    (None, ["more than the 16777216"]),  # a sparse file of 17 MiB: refused by its size, not read
])
def test_config_json_that_is_not_a_config_is_one_line(content, words, sandbox, checkpoint, tiny_corpus):  # noqa: F811
    path = checkpoint / "config.json"
    if content is None:
        os.truncate(path, 17 * 2**20)
    else:
        path.write_bytes(content)
    refused_by_both(sandbox, checkpoint, tiny_corpus, "config.json", *words)


def test_a_config_of_terabytes_is_refused_before_allocation(sandbox, checkpoint, tiny_corpus, monkeypatch):  # noqa: F811
    """8 TiB of parameters (a vocabulary of 2**24 by 2**16): `triax eval` checks the whole model
    against the host's memory, fine-tuning finds that the files do not hold it; neither allocates."""
    edit_config(checkpoint, vocab_size=2**24, hidden_size=2**16, intermediate_size=2**16, num_hidden_layers=1,
                num_attention_heads=512, num_key_value_heads=512, head_dim=128)
    forbid_allocation(monkeypatch)
    run_dir = sandbox.work / "run"
    argv = commands(checkpoint, tiny_corpus, run_dir)
    sandbox.refused(argv["eval"], "config.json describes a model of", "more than the")
    sandbox.refused(argv["train"], "has shape", "do not belong to this config")


# ---- links out of the checkpoint, special files among its description files --------------------

# config.json and tokenizer.json are read by both commands; the others only by fine-tuning, which
# copies them into RUN/init_from/ (and from there into the export): `triax eval` never opens them.
READ_BY_EVAL = ("config.json", "tokenizer.json")


def refused_by_readers(sandbox, directory, corpus, name, *words):  # noqa: F811
    for command, argv in commands(directory, corpus, sandbox.work / "run").items():
        if command == "train" or name in READ_BY_EVAL:
            sandbox.refused(argv, name, *words)


@pytest.mark.parametrize("name", ["merges.txt", "chat_template.jinja", "tokenizer.json", "config.json",
                                  "generation_config.json"])
def test_a_file_linked_outside_the_checkpoint_is_neither_read_nor_copied(name, sandbox, checkpoint, outside,
                                                                         tiny_corpus):
    secret = outside / name
    if (checkpoint / name).exists():
        shutil.move(checkpoint / name, secret)
    else:
        secret.write_text("a file that is not the checkpoint's\n")
    (checkpoint / name).symlink_to(os.path.abspath(secret))
    refused_by_readers(sandbox, checkpoint, tiny_corpus, name, "outside the checkpoint directory")


@pytest.mark.parametrize("name", ["merges.txt", "tokenizer.json", "chat_template.jinja"])
def test_a_fifo_among_the_description_files_is_refused_at_once(name, sandbox, checkpoint, tiny_corpus):  # noqa: F811
    (checkpoint / name).unlink(missing_ok=True)
    os.mkfifo(checkpoint / name)
    refused_by_readers(sandbox, checkpoint, tiny_corpus, name, "not a regular file")


def test_links_inside_the_checkpoint_and_a_cache_snapshot_are_followed(tmp_path, original):
    """What transformers' cache writes (models--org--name/snapshots/REV/FILE -> ../../blobs/HASH),
    and a link to another file of the directory, read as the files themselves."""
    from triax.train import init_from

    repository = tmp_path / "models--org--tiny"
    snapshot, blobs = repository / "snapshots" / "0123abc", repository / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for number, file in enumerate(sorted(original.iterdir())):
        shutil.copy(file, blobs / f"blob{number}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{number}")
    (snapshot / "sub").mkdir()
    (snapshot / "sub" / "merges.txt").write_text("#version: 0.2\n")
    (snapshot / "merges.txt").symlink_to("sub/merges.txt")
    source = init_from.resolve(str(snapshot))
    assert source.architecture["arch"] == "llama"
    assert source.description["merges.txt"] == os.path.realpath(snapshot / "sub" / "merges.txt")
    assert source.description["tokenizer.json"].startswith(os.path.realpath(blobs))
    from triax.interop.hf.whole_model import load_hf_model

    theirs, ours = hf_model("llama"), load_hf_model(str(snapshot), torch.device("cpu"))
    ids = torch.arange(20).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)


# ---- a tokenizer.json that makes the Rust library panic -----------------------------------------

CATASTROPHIC = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}


def test_a_tokenizer_that_panics_is_one_line(sandbox, checkpoint):  # noqa: F811
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = CATASTROPHIC
    (checkpoint / "tokenizer.json").write_text(json.dumps(tokenizer))
    corpus = sandbox.work / "corpus.txt"
    corpus.write_text(("a" * 60 + "c\n") * 50)
    refused_by_both(sandbox, checkpoint, corpus, "tokenizer", "failed inside the tokenizers library")


def test_the_panic_writes_nothing_to_the_terminal_and_other_output_passes(original, capfd):
    from triax.data.errors import DataError
    from triax.data.tokenizer import BPETokenizer

    tokenizer = json.loads((original / "tokenizer.json").read_text())
    good = BPETokenizer(json.dumps(tokenizer))
    tokenizer["pre_tokenizer"] = CATASTROPHIC
    bad = BPETokenizer(json.dumps(tokenizer), "bad.json")
    with pytest.raises(DataError, match="'bad.json' failed inside the tokenizers library"):
        bad.encode("a" * 60 + "c")
    assert capfd.readouterr().err == ""  # Rust's panic message and backtrace note were held back
    assert good.decode(good.encode("the quick fox")) == "the quick fox"
    assert capfd.readouterr().err == ""


# ---- the export of a run started from a checkpoint ---------------------------------------------

@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory, original, tiny_corpus):
    """One step of fine-tuning from the checkpoint: the run keeps its files in RUN/init_from/."""
    run_dir = tmp_path_factory.mktemp("tuned") / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{"model.init_from": str(original),
                                                                         "trainer.max_steps": 1})]) == 0
    assert (run_dir / "init_from" / "config.json").is_file()
    return run_dir


@pytest.fixture
def tuned_copy(tuned_run, sandbox):  # noqa: F811
    return shutil.copytree(tuned_run, sandbox.work / "run", symlinks=True)


@pytest.mark.parametrize("target", ["init_from", "init_from/export"])
def test_an_export_into_the_runs_kept_files_is_refused(target, sandbox, tuned_copy):  # noqa: F811
    """The next start of the run rewrites RUN/init_from/ (it deleted the export's config.json)."""
    sandbox.refused(["export", str(tuned_copy), str(tuned_copy / target), "--format", "hf"],
                    "inside the run's init_from/", "write the export somewhere else")
    sandbox.refused(["export", str(tuned_copy), str(tuned_copy / target / "m.safetensors")],
                    "inside the run's init_from/")


def test_a_linked_kept_directory_is_reported_not_left_out(sandbox, tuned_copy, outside):  # noqa: F811
    shutil.move(tuned_copy / "init_from", outside / "init_from")
    (tuned_copy / "init_from").symlink_to(outside / "init_from")
    sandbox.refused(["export", str(tuned_copy), str(sandbox.work / "hf"), "--format", "hf"],
                    "init_from is a link or not a directory")


@pytest.mark.parametrize("name", ["merges.txt", "generation_config.json"])
def test_a_kept_file_replaced_by_a_link_is_refused(name, sandbox, tuned_copy, outside):  # noqa: F811
    secret = outside / name
    secret.write_text("not the run's\n")
    (tuned_copy / "init_from" / name).unlink(missing_ok=True)
    (tuned_copy / "init_from" / name).symlink_to(secret)
    sandbox.refused(["export", str(tuned_copy), str(sandbox.work / "hf"), "--format", "hf"], name, "link")


def test_the_export_of_the_tuned_run_is_still_a_drop_in(tmp_path, tuned_run, original):
    """The checks refuse nothing they should not: the export carries the checkpoint's files."""
    out = tmp_path / "hf"
    assert triax_main(["export", str(tuned_run), str(out), "--format", "hf"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (original / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
