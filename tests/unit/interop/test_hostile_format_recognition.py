"""One path, one model: every reader of a checkpoint path (`triax train model.init_from=DIR`,
`trainer.continue_from=DIR`, `triax eval DIR`) recognises its format in one order
(triax/interop/formats.py), and a path two formats claim is refused with both named, never read as
whichever a reader asked first. A directory this user cannot read, or a file in it, is one line too.
The only outcomes: one line and exit code 2, nothing written (support/sandbox.py)."""

import errno
import os
import shutil

import pytest

from support.helpers import tiny_overrides
from support.llama_checkpoints import save_checkpoint

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'triax[test]')")


@pytest.fixture(scope="module")
def original(tmp_path_factory, tiny_corpus):
    directory = tmp_path_factory.mktemp("llama")
    save_checkpoint(directory, "llama", tiny_corpus)
    return directory


@pytest.fixture
def checkpoint(original, sandbox):
    return shutil.copytree(original, sandbox.work / "ckpt")


def readers(directory, corpus, run_dir):
    return {"init_from": ["train", *tiny_overrides(run_dir, corpus, **{"model.init_from": str(directory)})],
            "continue_from": ["train", *tiny_overrides(run_dir, corpus, **{"trainer.continue_from": str(directory)})],
            "eval": ["eval", str(directory), "--text", str(corpus)]}


OTHERS = {
    "nanoGPT's ckpt.pt": ("ckpt.pt", "nanoGPT's ckpt.pt"),
    "a triax run's model.json": ("model.json", "a triax run (model.json)"),
    "Meta's consolidated weights": ("consolidated.00.pth", "Meta's Llama folder"),
    "a DCP .metadata": (".metadata", "a torchtitan DCP folder"),
}


@pytest.mark.parametrize("other", list(OTHERS))
@pytest.mark.parametrize("reader", ["init_from", "continue_from", "eval"])
def test_two_formats_in_one_directory_are_refused_with_both_named(reader, other, sandbox, checkpoint, tiny_corpus):
    name, words = OTHERS[other]
    (checkpoint / name).write_bytes(b"\0" * 16)
    argv = readers(checkpoint, tiny_corpus, sandbox.work / "run")[reader]
    sandbox.refused(argv, "holds both", words, "a transformers checkpoint (config.json)", "give a directory holding one")


def test_a_fifo_config_json_is_named_not_missing(sandbox, checkpoint, tiny_corpus):
    os.remove(checkpoint / "config.json")
    os.mkfifo(checkpoint / "config.json")
    for reader in ("init_from", "eval"):
        sandbox.refused(readers(checkpoint, tiny_corpus, sandbox.work / "run")[reader], "config.json",
                        "not a regular file")


def _denied_for(monkeypatch, module_function, target):
    """`os.<function>` failing with EACCES on `target`: root reads every directory, so the test
    makes the refusal a user without the permission meets."""
    name = module_function
    real = getattr(os, name)

    def denied(path, *args, **kwargs):
        if os.fspath(path) == os.fspath(target):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, denied)


@pytest.mark.parametrize("reader", ["init_from", "eval"])
def test_an_unreadable_directory_is_one_line(reader, sandbox, checkpoint, tiny_corpus, monkeypatch):
    _denied_for(monkeypatch, "listdir", checkpoint)
    sandbox.refused(readers(checkpoint, tiny_corpus, sandbox.work / "run")[reader], "cannot be read",
                    "Permission denied", str(checkpoint))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
@pytest.mark.parametrize("reader", ["init_from", "eval"])
def test_an_unreadable_file_is_one_line(reader, name, sandbox, checkpoint, tiny_corpus, monkeypatch):
    _denied_for(monkeypatch, "open", checkpoint / name)
    sandbox.refused(readers(checkpoint, tiny_corpus, sandbox.work / "run")[reader], name, "Permission denied")


def test_an_adapter_beside_a_checkpoint_is_named(checkpoint, capsys):
    from triax.interop.formats import recognise

    (checkpoint / "adapter_config.json").write_text("{}")
    assert recognise(str(checkpoint)) == "hf"
    err = capsys.readouterr().err
    assert "adapter_config.json" in err and "not the adapter" in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_without_tokenizer_is_named_as_such(sandbox, checkpoint, tiny_corpus):
    """model.init_from was given: the line names its missing tokenizer.json, not a missing model.init_from."""
    from support.preference_files import preference_records, write_preference_file

    os.remove(checkpoint / "tokenizer.json")
    pairs = write_preference_file(sandbox.work / "pairs.jsonl", preference_records(8, "standard"))
    overrides = tiny_overrides(sandbox.work / "run", tiny_corpus, **{"model.init_from": str(checkpoint),
                                                                     "data.task": "preference", "data.path": pairs})
    sandbox.refused(["train", *overrides], f"model.init_from='{checkpoint}' has no tokenizer.json")
