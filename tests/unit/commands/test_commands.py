"""The `triax` commands (triax/commands/): one module per command, each owning its one parser;
the library never imports a command; an option of another form of a command is refused by name."""

import ast
import os

import pytest

from triax.commands import cli
from triax.commands.cli import main as triax_main

from support import REPO_DIR

PACKAGE = os.path.join(REPO_DIR, "triax")


def test_every_command_is_routed_to_a_module_with_main():
    import importlib

    for name, (module_name, _) in cli.COMMANDS.items():
        module = importlib.import_module(module_name)
        assert callable(getattr(module, "main", None)), (name, module_name)


def test_every_command_is_a_module_of_triax_commands():
    assert [name for name, (module_name, _) in cli.COMMANDS.items()
            if not module_name.startswith("triax.commands.")] == []


def test_no_library_module_imports_a_command():
    importers = []
    for directory, _, names in os.walk(PACKAGE):
        if os.path.abspath(directory).startswith(os.path.join(PACKAGE, "commands")):
            continue
        for name in (n for n in names if n.endswith(".py")):
            path = os.path.join(directory, name)
            if os.path.relpath(path, PACKAGE) == "__main__.py":  # `python -m triax` is the command line
                continue
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                           else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
                if any(module == "triax.commands" or module.startswith("triax.commands.") for module in modules):
                    importers.append(os.path.relpath(path, REPO_DIR))
    assert not importers, f"library modules import a command module: {importers}"


@pytest.mark.parametrize("argv, option", [
    (["tokenize", "in.txt", "--out", "tokens", "--block-size", "8"], "--block-size"),  # --chat's
    (["tokenize", "in.txt", "--out", "tokens", "--chat", "ckpt", "--vocab-size", "300"], "--vocab-size"),
    (["tokenize", "in.txt", "--out", "tokens", "--preference", "ckpt", "--overlong", "drop"], "--overlong"),
    (["tokenize", "in.txt", "--out", "tokens", "--chat", "ckpt", "--preference", "ckpt"], "--preference"),
])
def test_an_option_of_another_form_of_tokenize_is_unknown(argv, option, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert triax_main(argv) == 2
    error = capsys.readouterr().err
    assert f"unknown option '{option}'" in error and error.count("\n") == 1, error


@pytest.mark.parametrize("argv, words", [
    (["generate", "runs/gpt", "--system", "be brief"], ["--system", "--chat"]),
    (["generate", "runs/gpt", "--chat", "hi", "--prompt", "x"], ["--prompt", "--chat"]),
    (["export", "runs/gpt", "out", "--merge"], ["--merge", "--format hf"]),
    (["export", "runs/gpt", "out", "--format", "hf", "--merge", "--force"], ["--force"]),
])
def test_options_of_another_form_are_refused_in_one_line(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert triax_main(argv) == 2
    error = capsys.readouterr().err
    assert all(word in error for word in words) and error.count("\n") == 1, error


@pytest.mark.parametrize("argv, error_class, start", [
    (["tokenize", "in.txt", "--out", "tokens", "--block-size", "8"], "DataError",
     "triax tokenize: unknown option '--block-size' (options are taken only by their whole names) (see --help)"),
    (["tokenize", "in.txt", "--out", "tokens", "--chat", "ckpt", "--vocab-size=300"], "UsageError",
     "triax tokenize --chat: unknown option '--vocab-size=300' (options are taken only by their whole names) "
     "(see triax tokenize --chat --help)"),
    (["tokenize", "in.txt", "--out", "tokens", "--preference", "ckpt", "--chat", "ckpt"], "UsageError",
     "triax tokenize --chat: unknown option '--preference'"),
    (["tokenize", "in.txt", "--out", "tokens", "--preference", "ckpt", "--overlong", "drop"], "UsageError",
     "triax tokenize --preference: unknown option '--overlong'"),
    (["generate", "runs/gpt", "--chat", "hi", "--tokens", "x"], "UsageError",
     "triax generate --chat: argument --tokens: invalid int value: 'x' (see triax generate --chat --help)"),
    (["export", "runs/gpt", "out", "--format", "peft", "--bogus"], "UsageError",
     "triax export --format peft: unknown option '--bogus'"),
    (["export", "runs/gpt", "out", "--format", "hf", "--merge", "--bogus"], "UsageError",
     "triax export --format hf --merge: unknown option '--bogus'"),
    (["doctor", "--gpu-suite", "--store-timeout", "5"], "UsageError",
     "triax doctor --gpu-suite: unknown option '--store-timeout' (options are taken only by their whole names) "
     "(see triax doctor --gpu-suite --help)"),
    (["doctor", "--budget=5"], "UsageError", "triax doctor: unknown option '--budget=5'"),
])
def test_an_error_names_the_form_of_the_command_as_its_own_parser_did(argv, error_class, start, tmp_path,
                                                                       monkeypatch):
    """One parser per command, but each form's errors read as that form's parser wrote them, with
    the class a caller caught: tokenize's plain form a DataError, its other forms a UsageError."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as raised:
        cli.run_command(argv)
    assert type(raised.value).__name__ == error_class and str(raised.value).startswith(start), raised.value
