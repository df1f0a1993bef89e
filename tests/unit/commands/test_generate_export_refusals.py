"""`triax generate`, `export` and `eval` on a damaged or hostile run directory: one line, exit code 2,
nothing changed (or, for damaged tensor bytes, a fall-back to the previous snapshot). Each case runs
the CLI's main in-process inside a sandbox (support/sandbox.py) on a copy of one trained run."""

import os

import pytest

from support.helpers import tiny_overrides
from triax.commands.cli import main as triax_main


GENERATE_CASES = {
    "zero temperature": (["--temperature", "0"], ["--temperature 0.0", "--greedy"]),
    "negative temperature": (["--temperature", "-1"], ["--temperature -1.0"]),
    "nan temperature": (["--temperature", "nan"], ["--temperature nan"]),
    "zero top-k": (["--top-k", "0"], ["--top-k 0"]),
    "vanishing temperature": (["--temperature", "1e-300"], ["--temperature 1e-300"]),
    "unbounded tokens": (["--tokens", str(10**12)], ["--tokens"]),
    "empty prompt": (["--prompt", ""], ["--prompt ''"]),
    "prompt outside the vocabulary": (["--prompt", "XYZ"], ["'XYZ'", "not in the training vocabulary"]),
    "bogus device": (["--device", "bogus"], ["--device 'bogus'"]),
    "negative tokens": (["--tokens", "-5"], ["--tokens -5"]),
    "negative seed": (["--seed", "-1"], ["--seed -1"]),
    "malformed number": (["--top-k", "many"], ["--top-k", "many"]),
    "unknown option": (["--colour", "red"], ["--colour"]),
    "repeated option": (["--tokens", "5", "--tokens", "500"], ["option --tokens given more than once"]),
}


@pytest.mark.parametrize("name", list(GENERATE_CASES))
def test_generate_refuses(name, sandbox, run_copy):
    options, words = GENERATE_CASES[name]
    sandbox.refused(["generate", str(run_copy), *options], *words)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_cuda_without_cuda(sandbox, run_copy):
    sandbox.refused(["generate", str(run_copy), "--device", "cuda"], "CUDA is not available")


def test_generate_works_on_the_copy(sandbox, run_copy, capsys):
    """The cases above fail for their argument alone: the same run generates fine."""
    assert triax_main(["generate", str(run_copy), "--prompt", "ab", "--tokens", "5", "--top-k", "2"]) == 0
    assert capsys.readouterr().out.startswith("ab")


DAMAGED_MODEL_JSON = {
    "huge n_embd": ('{"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32768}',
                    ["model.json", "stores only"]),
    "beyond any limit": ('{"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 10000000000}',
                         ["model.json", "n_embd=10000000000"]),
    "not JSON": ("{nope", ["model.json", "damaged"]),
    "a list": ("[]", ["model.json", "damaged"]),
    "wrong type": ('{"vocab_size": "65", "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}',
                   ["vocab_size='65'"]),
    "unknown key": ('{"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "evil": 1}',
                    ["unknown key(s) evil"]),
}


@pytest.mark.parametrize("name", list(DAMAGED_MODEL_JSON))
@pytest.mark.parametrize("command", ["generate", "export"])
def test_damaged_model_json_is_refused_before_allocating(name, command, sandbox, run_copy):
    text, words = DAMAGED_MODEL_JSON[name]
    (run_copy / "model.json").write_text(text)
    extra = [str(sandbox.work / "out.safetensors")] if command == "export" else []
    sandbox.refused([command, str(run_copy), *extra], *words)


def test_damaged_vocabulary_is_refused(sandbox, run_copy):
    (run_copy / "vocab.json").write_text('{"chars": 5}')
    sandbox.refused(["generate", str(run_copy)], "vocab.json", "damaged")


def test_not_a_run_directory(sandbox):
    sandbox.refused(["generate", str(sandbox.work)], "not a triax run directory")


def test_export_to_a_directory(sandbox, run_copy):
    (sandbox.work / "exports").mkdir()
    sandbox.refused(["export", str(run_copy), str(sandbox.work / "exports")], "is a directory")


def test_export_into_a_missing_directory(sandbox, run_copy):
    sandbox.refused(["export", str(run_copy), str(sandbox.work / "nowhere" / "m.safetensors")], "does not exist")


def test_export_over_the_snapshot_own_file(sandbox, run_copy):
    from triax import checkpoint

    snapshot = checkpoint.latest_snapshot(str(run_copy / "snapshots"))
    target = os.path.join(snapshot, "model.safetensors")
    sandbox.refused(["export", str(run_copy), target, "--force"], "inside the run's snapshots")


def test_export_over_the_run_model_json(sandbox, run_copy):
    sandbox.refused(["export", str(run_copy), str(run_copy / "model.json"), "--force"], "run's own model.json")


def test_export_over_a_file_triax_did_not_write_needs_force(sandbox, run_copy, capsys):
    precious = sandbox.work / "notes.txt"
    precious.write_text("mine")
    sandbox.refused(["export", str(run_copy), str(precious)], "not written by triax", "--force")
    assert precious.read_text() == "mine"
    # An earlier export is triax's own: replaced without --force; a foreign file with --force.
    out = sandbox.work / "model.safetensors"
    assert triax_main(["export", str(run_copy), str(out)]) == 0
    assert triax_main(["export", str(run_copy), str(out)]) == 0
    assert triax_main(["export", str(run_copy), str(precious), "--force"]) == 0
    leftovers = [name for name in os.listdir(sandbox.work) if name.endswith(".tmp")]
    assert leftovers == []


@pytest.mark.parametrize("name", ["vocab.json", "config.yaml", "model.json"])
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_fifo_in_the_run_is_refused_at_once(name, command, sandbox, run_copy):
    os.remove(run_copy / name)
    os.mkfifo(run_copy / name)
    extra = [str(sandbox.work / "out.safetensors")] if command == "export" else []
    sandbox.refused([command, str(run_copy), *extra], name)


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_an_alias_bomb_in_the_runs_config_is_one_line(command, sandbox, run_copy):
    """The run's config.yaml goes through the one bounded YAML reader (triax/safe_yaml.py): a few
    hundred bytes of nested aliases are refused by count, not expanded until memory runs out."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
              f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
              for i in range(8)]
    (run_copy / "config.yaml").write_text("\n".join(lines) + "\n")
    sandbox.refused([command, str(run_copy)], "config.yaml")


def test_a_huge_sparse_model_json_is_not_read(sandbox, run_copy):
    with open(run_copy / "model.json", "r+b") as handle:
        handle.truncate(6 * 2**30)
    sandbox.refused(["generate", str(run_copy)], "model.json", "bytes")


def test_failed_hf_export_leaves_nothing_and_the_retry_works(sandbox, run_copy, monkeypatch, capsys):
    from triax.interop.hf import export as hf_export

    out = sandbox.work / "hf"
    real = hf_export.hf_config

    def broken(config):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "hf_config", broken)
    with pytest.raises(OSError):
        triax_main(["export", str(run_copy), str(out), "--format", "hf"])
    assert not out.exists()
    monkeypatch.setattr(hf_export, "hf_config", real)
    assert triax_main(["export", str(run_copy), str(out), "--format", "hf"]) == 0
    assert (out / "model.safetensors").stat().st_size > 0


def test_model_json_larger_than_the_snapshot_tensors_is_refused(sandbox, run_copy):
    """A sparse 2 TiB file in the snapshot does not make a huge model.json believable: the model
    is matched against the snapshot's tensors, before it is built."""
    import json

    from triax import checkpoint

    snapshot = checkpoint.latest_snapshot(str(run_copy / "snapshots"))
    with open(os.path.join(snapshot, "padding.bin"), "wb") as handle:
        handle.truncate(2 * 2**40)
    values = json.loads((run_copy / "model.json").read_text())
    values["n_embd"] = 2**15
    # A consistent model.json (the widths that follow from n_embd too), so only its size is wrong.
    values.update(n_head=256, n_kv_head=256, head_dim=128, intermediate_size=4 * 2**15)
    (run_copy / "model.json").write_text(json.dumps(values))
    sandbox.refused(["generate", str(run_copy)], "model.json", "stores only")


def test_a_run_config_cannot_send_generate_to_another_host(sandbox, run_copy, monkeypatch):
    import fsspec
    import yaml

    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["trainer"]["snapshot_dir"] = "ftp://attacker.example/"
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config))

    def no_network(*args, **kwargs):
        raise AssertionError("generate tried to reach the host")

    monkeypatch.setattr(fsspec, "filesystem", no_network)
    monkeypatch.setattr(fsspec.core, "url_to_fs", no_network)
    sandbox.refused(["generate", str(run_copy)], "ftp://", "snapshot_dir")
    sandbox.refused(["export", str(run_copy), str(sandbox.work / "m.safetensors")], "ftp://")


def _damage_tensor_bytes(snapshot):
    """Flip one byte of the tensor data: the manifest and shard metadata still vouch for the file's
    size, so only the chunk's sha256, checked as it is read, finds it."""
    shard = os.path.join(snapshot, "shards", "rank_00000.bin")
    with open(shard, "r+b") as handle:
        handle.seek(8)
        byte = handle.read(1)
        handle.seek(8)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_damaged_tensor_bytes_make_export_and_generate_fall_back(tmp_path, tiny_corpus, capsys):
    run_dir = tmp_path / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, tiny_corpus, **{
        "trainer.max_steps": 2, "trainer.save_every": 1})]) == 0
    _damage_tensor_bytes(str(run_dir / "snapshots" / "step_00000002"))
    for argv in (["export", str(run_dir), str(tmp_path / "m.safetensors")],
                 ["export", str(run_dir), str(tmp_path / "hf"), "--format", "hf"],
                 ["generate", str(run_dir), "--tokens", "3", "--prompt", "the"]):
        capsys.readouterr()
        assert triax_main(argv) == 0, argv
        captured = capsys.readouterr()
        assert "sha256" in captured.err and "trying the previous snapshot" in captured.err, captured.err
    assert (tmp_path / "m.safetensors").exists() and (tmp_path / "hf" / "model.safetensors").exists()
    assert os.path.isdir(run_dir / "snapshots" / "step_00000002")  # read-only commands move nothing


def test_hf_export_inside_the_snapshots_is_refused(sandbox, run_copy):
    sandbox.refused(["export", str(run_copy), str(run_copy / "snapshots" / "hf"), "--format", "hf"],
                    "inside the run's snapshots")


def test_control_characters_in_a_path_are_escaped(sandbox, run_copy):
    """A message that quotes a path as it is (here: model.json is damaged) still prints one line,
    with the newline and the terminal escape shown escaped."""
    evil = sandbox.work / "evil\n\x1b[2Jrun"
    os.rename(run_copy, evil)
    (evil / "model.json").write_text("{nope")
    err = sandbox.refused(["generate", str(evil)], "model.json", "damaged")
    assert "\x1b" not in err and "\\n\\x1b[2Jrun" in err
