"""One rule for output places, every command that writes a directory: a place that cannot be made
(its parent a file, under /proc, a name too long, empty, a read-only parent) or that lies in a run's
snapshots or kept files is one line and exit 2, naming the place and why, before anything
expensive is read, and nothing is written (support/sandbox.py checks the whole sandbox)."""

import os
import shutil

import pytest

from support.chat_files import write_chat_checkpoint
from support.preference_files import preference_records, write_preference_file


def places(work):
    """{case: (OUT, words the line must hold)}; `work` holds a file named `a-file`."""
    return {
        "parent is a file": (str(work / "a-file" / "out"), ["a-file is a file"]),
        "under /proc": ("/proc/triax-out", ["/proc", "kernel filesystem"]),
        "name too long": (str(work / ("n" * 300)), ["longer than the filesystem allows"]),
        "empty": ("", ["the name is empty"]),
        "read-only parent": (str(work / "read-only" / "out"), ["read-only", "not writable"]),
    }


@pytest.fixture
def hostile_places(sandbox, monkeypatch):
    """The places of `places`, with the read-only parent read-only to this process even as root."""
    (sandbox.work / "a-file").write_text("x")
    (sandbox.work / "read-only").mkdir()
    read_only = str(sandbox.work / "read-only")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (False if os.fspath(path) == read_only
                                                                else real_access(path, mode, **kw)))
    return places(sandbox.work)


def check_one_of(sandbox, argv, words):
    err = sandbox.refused(argv)
    assert any(word in err for word in words), err
    return err


EXPORTS = {"hf": ["--format", "hf"], "peft": ["--format", "peft"], "merge": ["--format", "hf", "--merge"],
           "nanogpt": ["--format", "nanogpt"]}


@pytest.mark.parametrize("case", list(places(__import__("pathlib").Path("/w"))))
@pytest.mark.parametrize("form", list(EXPORTS))
def test_export_refuses_a_place_before_reading_the_snapshot(case, form, sandbox, run_copy, hostile_places):
    # No snapshot left: had the export read before it checked OUT, the line would say so instead.
    shutil.rmtree(run_copy / "snapshots")
    out, words = hostile_places[case]
    err = check_one_of(sandbox, ["export", str(run_copy), out, *EXPORTS[form]], words)
    assert "OUT_DIR" in err and "snapshot" not in err


def test_export_refuses_a_file_place_before_reading(sandbox, run_copy, hostile_places):
    shutil.rmtree(run_copy / "snapshots")
    out, words = hostile_places["parent is a file"]
    check_one_of(sandbox, ["export", str(run_copy), out + ".safetensors"], words)


def test_export_into_another_runs_snapshots(sandbox, run_copy):
    other = shutil.copytree(run_copy, sandbox.work / "other")
    sandbox.refused(["export", str(run_copy), str(other / "snapshots" / "out"), "--format", "hf"],
                    "inside the run's snapshots")


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("places") / "base"
    write_chat_checkpoint(directory)
    return directory


def tokenize_forms(checkpoint, work):
    pairs = write_preference_file(work / "pairs.jsonl", preference_records(12))
    text = work / "text.txt"
    text.write_text("ab cd ef " * 200)
    return {"preference": ["--preference", str(checkpoint), str(pairs)],
            "chat": ["--chat", str(checkpoint), str(pairs)], "text": [str(text), "--vocab-size", "280"]}


@pytest.mark.parametrize("case", list(places(__import__("pathlib").Path("/w"))))
@pytest.mark.parametrize("form", ["preference", "chat", "text"])
def test_tokenize_refuses_a_place(case, form, sandbox, chat_checkpoint, hostile_places):
    argv = tokenize_forms(chat_checkpoint, sandbox.work)[form]
    out, words = hostile_places[case]
    err = check_one_of(sandbox, ["tokenize", *argv, "--out", out], words)
    assert "--out" in err


RUN_PLACES = {
    "the run's snapshots": (("snapshots", "tokens"), "inside the run's snapshots"),
    "the run's kept files": (("init_from", "tokens"), "init_from/"),
    "the run itself": ((), "is a triax run directory"),
}


@pytest.mark.parametrize("case", list(RUN_PLACES))
def test_tokenize_keeps_out_of_a_run(case, sandbox, run_copy, chat_checkpoint):
    parts, words = RUN_PLACES[case]
    argv = tokenize_forms(chat_checkpoint, sandbox.work)["preference"]
    sandbox.refused(["tokenize", *argv, "--out", str(run_copy.joinpath(*parts))], "--out", words)


def test_tokenize_beside_a_run_still_writes(sandbox, run_copy, chat_checkpoint):
    """Valid places are unchanged: a new directory inside the run directory, not in its snapshots."""
    from triax.commands.cli import main

    argv = tokenize_forms(chat_checkpoint, sandbox.work)["preference"]
    assert main(["tokenize", *argv, "--out", str(run_copy / "tokens" / "pairs")]) == 0
    assert (run_copy / "tokens" / "pairs" / "meta.json").is_file()


@pytest.mark.parametrize("case", list(places(__import__("pathlib").Path("/w"))))
def test_config_refuses_a_file_place(case, sandbox, hostile_places):
    out, words = hostile_places[case]
    out = out + "/default_config.yaml" if out and case != "empty" else out
    words = ["--config-file is empty"] if case == "empty" else words + ["not a writable directory"]
    check_one_of(sandbox, ["config", "--default", "--config-file", out], words)


@pytest.mark.parametrize("case", list(places(__import__("pathlib").Path("/w"))))
def test_bench_refuses_a_place_before_any_job(case, sandbox, hostile_places):
    out, words = hostile_places[case]
    words = words + ["give a directory"] if case == "empty" else words  # bench's own check of an empty name
    err = check_one_of(sandbox, ["bench", "--nproc", "1", "--out", out], words)
    assert "--out" in err


@pytest.mark.parametrize("case", list(places(__import__("pathlib").Path("/w"))))
def test_doctor_refuses_a_report_place_before_any_check(case, sandbox, hostile_places):
    """A file output (check_output_file, which export's safetensors form shares): the same places."""
    out, words = hostile_places[case]
    out = out + ".json" if out else out
    words = words + ["does not exist", "give a file name", "cannot write in"]
    err = check_one_of(sandbox, ["doctor", "--json", out], words)
    assert "--json" in err
