"""Command-line arguments of every `triax` command: parsing and range checks, before any work.

argparse prints a usage block and exits on a malformed argument; triax's commands instead fail
like every other triax error: one line (`triax: error: ...`) and exit code 2, from the CLI's
main, so a script or a test sees the same shape of failure whatever was wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import stat
import struct
import sys
import zipfile

from triax import safe_files
from triax.errors import UsageError


# Options meant to be given more than once.
REPEATABLE = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction, argparse._ExtendAction,
              argparse._HelpAction, argparse._VersionAction)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument raises UsageError (one line) instead of exiting, and an option
    is only ever its whole name: with abbreviations `--val FILE` would be read as `--val-fraction`
    and refused with a message about a number."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {plain_message(message)} (see {self.prog} --help)")

    def parse_known_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None):
        words = list(sys.argv[1:] if args is None else args)
        self.refuse_repeats(words)
        return super().parse_known_args(words, namespace)

    def refuse_repeats(self, words: list[str]) -> None:
        """An option of one value given twice is refused: argparse keeps the last without a word, so
        `--tokens 5 ... --tokens 500000` would run the second. A parser that hands the rest of its
        command line on (torchrun's and horovodrun's, whose own parsers keep the last) is left as
        they are; options meant to repeat (append, count) may."""
        if any(action.nargs == argparse.REMAINDER for action in self._actions):
            return
        seen: dict = {}
        for word in words:
            if word == "--":
                return
            action = self._option_string_actions.get(word.split("=", 1)[0])
            if action is None or isinstance(action, REPEATABLE):
                continue
            name = word.split("=", 1)[0]
            if action in seen:
                also = f" (as {seen[action]})" if seen[action] != name else ""
                self.error(f"option {name} given more than once{also}; give it once")
            seen[action] = name


class FormOption(argparse.Action):
    """An option that chooses a form of its command (`triax generate --chat`, `triax doctor
    --gpu-suite`): once it is read, the parser's errors name that form (`triax generate --chat:
    ... (see triax generate --chat --help)`), as each form's own parser did before one parser took
    them all. `when`: only this value chooses the form (`--format peft`); `rank`: a form of a
    higher rank is kept when a lower one follows (`--chat` over `--preference`), as the forms
    were told apart before. A switch (`switch=True`) takes no value and stores True."""

    def __init__(self, option_strings: list[str], dest: str, form: str, when: object = None, rank: int = 1,
                 switch: bool = False, **kwargs: object):
        if switch:
            kwargs.update(nargs=0, default=False)
        super().__init__(option_strings, dest, **kwargs)
        self.form, self.when, self.rank, self.switch = form, when, rank, switch

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.switch else values)
        if (self.when is None or values == self.when) and self.rank >= getattr(parser, "form_rank", 0):
            parser.prog, parser.form_rank = self.form, self.rank


def plain_message(message: str) -> str:
    """argparse's message, but an option it does not know is called that (it says 'unrecognized
    arguments' for `--val FILE`, an abbreviation it no longer expands)."""
    prefix = "unrecognized arguments: "
    unknown = message[len(prefix):].split() if message.startswith(prefix) else []
    options = [word for word in unknown if word.startswith("-")]
    if options:
        return f"unknown option {options[0]!r} (options are taken only by their whole names)"
    return message


def need(ok: bool, option: str, value, what: str) -> None:
    """Raise UsageError naming `option` and `value` unless `ok`."""
    if not ok:
        raise UsageError(f"{option} {value!r} is invalid; {what}")


def at_least(option: str, value, minimum) -> None:
    need(isinstance(value, (int, float)) and math.isfinite(value) and value >= minimum, option, value,
         f"use {minimum} or more")


def positive(option: str, value) -> None:
    """A finite number above zero (a rate, a size, a temperature)."""
    need(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, option, value,
         "use a number above 0")


def check_device(option: str, requested: str, allow_auto: bool = True) -> None:
    """cpu | cuda | cuda:N (| auto): the spelling only; whether CUDA exists is checked where it is used."""
    import torch  # deferred: the CLI checks its options (and OMP_NUM_THREADS) before torch loads

    if allow_auto and requested == "auto":
        return
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError, TypeError):
        device = None
    need(device is not None and device.type in ("cpu", "cuda"), option, requested,
         "use cpu, cuda or cuda:N" + (" (or auto)" if allow_auto else ""))


def written_by_triax_safetensors(path: str, key: str = "triax_model") -> bool:
    """Whether `path` is a regular file (not a link) holding a safetensors header whose metadata
    carries triax's mark `key` (the model's description): an export triax may replace. Reads only
    the header."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100 * 2**20:
                return False
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return False
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(metadata, dict) and key in metadata


def check_output_file(option: str, path: str, force: bool, written_by_triax) -> None:
    """An output file may be created, or replace a file triax wrote; anything else needs --force."""
    need(path.strip() != "", option, path, "give a file name")
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a directory; give the path of a file to write")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{option} {path!r}: its directory {directory!r} does not exist; create it first")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{option} {path!r}: cannot write in {directory!r}")
    safe_files.check_output_place(option, path, directory=False)  # a kernel filesystem, a name too long, read-only
    if os.path.lexists(path) and not force and not written_by_triax(path):
        raise UsageError(f"{option} {path!r} already exists and was not written by triax; "
                         "choose another path, or add --force to replace it")


def check_output_directory(option: str, directory: str, files: dict, force: bool) -> None:
    """The kept-directory rule of every export and report written into a directory: the directory
    is new or a real directory (not a link, not a file), and each file triax would write there
    (`files`: {name: whether triax wrote the file at a path}) is absent, or one triax wrote; a
    foreign file, a link or anything but a regular file needs --force (and is then replaced
    itself, a link's target untouched)."""
    need(directory.strip() != "", option, directory, "give a directory")
    if os.path.lexists(directory) and (os.path.islink(directory) or not os.path.isdir(directory)):
        raise UsageError(f"{option} {directory!r} exists and is not a directory of its own (a file or a link); "
                         "give a new directory")
    for name, written_by_triax in files.items():
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):  # not replaceable by a file, --force or not
            raise UsageError(f"{option} {directory!r} holds a directory named {name}, where triax writes a file; "
                             "remove it or choose another directory")
        if not os.path.lexists(path) or force:
            continue
        if os.path.islink(path) or not written_by_triax(path):
            raise UsageError(f"{option} {directory!r} already holds {name}, which triax did not write (or a link); "
                             "choose another directory, or add --force to replace it")


def written_by_triax_pickle(path: str) -> bool:
    """Whether `path` is a regular file holding a torch.save archive whose pickle marks it triax's
    export (`exported_by: triax`). Reads the archive's index and its small pickle, not its tensors."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with zipfile.ZipFile(path) as archive:
            entries = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
            if len(entries) != 1 or entries[0].file_size > 16 * 2**20:
                return False
            data = archive.read(entries[0])
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return False
    return b"exported_by" in data and b"triax" in data


def check_script(script: str, module: bool) -> None:
    """The Python script (or `-m` module) a launcher starts must exist before N copies each fail."""
    if module:
        import importlib.util  # deferred: only a launch with -m needs it

        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"module {script!r} cannot be found from here (python -m {script} would fail); "
                             "check the name and the current directory / PYTHONPATH")
    elif not os.path.isfile(script):
        what = "is a directory" if os.path.isdir(script) else "does not exist"
        raise UsageError(f"training script {script!r} {what}; give the path of a Python file "
                         "(or -m module.name)")


# Python's options that take a value in the next argument (python --help): skipped to find the script.
PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")
PYTHON_PROGRAM = re.compile(r"python(\d+(\.\d+)?)?")


def check_command(command: list[str], example: str) -> None:
    """A training command a launcher runs on every process (`python train.py ...`, `./train.sh`):
    its program must be runnable and, for Python, its script or module must exist. `example` is
    the launcher's correct command line, shown with the most common slip (`train.py` without
    `python`, which the system reports as a missing file although the file is there)."""
    program = command[0]
    if "/" in program:
        runnable = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        runnable = shutil.which(program) is not None
    if not runnable:
        if program.endswith(".py") and os.path.isfile(program):
            raise UsageError(f"{program!r} is a Python script, not a program: put python before it "
                             f"(e.g. {example})")
        where = "is not executable" if os.path.isfile(program) else (
            "does not exist" if "/" in program else "is not a program on PATH")
        raise UsageError(f"the training command's program {program!r} {where}; e.g. {example}")
    if not PYTHON_PROGRAM.fullmatch(os.path.basename(program)):
        return
    arguments = iter(command[1:])
    for argument in arguments:
        if argument == "-c" or argument == "-":  # code on the command line or stdin: nothing to find
            return
        if argument == "-m":
            return check_script(next(arguments, ""), module=True)
        if argument.startswith("-m") and not argument.startswith("--"):
            return check_script(argument[2:], module=True)
        if argument in PYTHON_OPTIONS_WITH_VALUE:
            next(arguments, None)
        elif not argument.startswith("-"):
            return check_script(argument, module=False)
    raise UsageError(f"the training command {' '.join(command)!r} names no script for {program} to run; "
                     f"e.g. {example}")
