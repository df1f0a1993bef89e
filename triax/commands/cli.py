"""The `triax` command: one entry point that hands each sub-command to its own module.

Each sub-command's module exposes `main(argv) -> int` and owns its parser, so this file only
routes; it never grows with features.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

from triax.errors import TriaxError, printable
from triax.launch.settings import ERRORS_REPORTED_BY_LAUNCHER_ENV
from triax.runtime.threads import check_thread_setting
from triax.runtime.torch_logs import quiet_torch_logs

# sub-command -> (its module, whose main(argv) runs it; one-line help)
COMMANDS = {
    "train": ("triax.commands.train", "train a GPT or Llama-family model from a Hydra config"),
    "generate": ("triax.commands.generate", "sample text from a trained run (--chat: answer a message)"),
    "export": ("triax.commands.export",
               "write a run's weights as one safetensors file (or --format hf, or a LoRA run's --format peft)"),
    "eval": ("triax.commands.eval", "loss and perplexity of a run or a transformers model on a split or files"),
    "tokenize": ("triax.commands.tokenize", "text files -> BPE token files for data.task=tokens"),
    "plan": ("triax.commands.plan", "list parallel layouts that fit a model on given devices"),
    "config": ("triax.commands.config", "write the default launch configuration"),
    "launch": ("triax.commands.launch", "start a script on several processes (torchrun front end)"),
    "env": ("triax.commands.env", "print versions, devices and config for bug reports"),
    "horovodrun": ("triax.commands.horovodrun", "horovodrun-compatible launcher (torchrun; elastic driver)"),
    "bench": ("triax.commands.bench", "measure throughput and scaling side by side"),
    "doctor": ("triax.commands.doctor", "check this machine and cluster before a long run (table + JSON)"),
}


# Commands whose remaining arguments belong to the user's script: a --debug there is the
# script's own flag, not ours.
PASS_THROUGH = {"launch", "horovodrun"}


def take_debug_flag(argv: list[str]) -> bool:
    """Remove triax's --debug from argv (in place) and say whether debugging is on."""
    debug = os.environ.get("TRIAX_DEBUG", "") not in ("", "0")
    while argv and argv[0] == "--debug":
        argv.pop(0)
        debug = True
    if argv and argv[0] not in PASS_THROUGH and "--debug" in argv:
        argv.remove("--debug")
        debug = True
    return debug


def _usage() -> str:
    lines = ["usage: triax COMMAND [args...]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "add --debug (or set TRIAX_DEBUG=1) to see full tracebacks"]
    return "\n".join(lines)


def run_command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("--version", "version"):
        from triax.version import __version__

        print(f"triax {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        raise TriaxError(f"unknown command {name!r}; commands are: {', '.join(COMMANDS)}")
    module_name, _ = COMMANDS[name]
    # Checked like an option, before the command imports torch (whose OpenMP runtime would warn
    # about a bad value and carry on with its own count): triax.runtime.threads.
    check_thread_setting()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise TriaxError(f"'triax {name}' is not available in this build ({module_name} missing)") from None
        raise
    return int(module.main(rest) or 0)


def report_error(line: str) -> None:
    """Print a command's one-line error once per job. Under torchrun every rank of a job meets the
    same bad input, and torchrun ends with a summary of its own: the line goes into the error file
    torchrun gives each worker (TORCHELASTIC_ERROR_FILE), which that summary shows for the first
    failing rank, and only rank 0 prints it as well; under `triax launch`, which prints the first
    failing rank's line last, no rank does."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w", encoding="utf-8") as handle:
                # torchrun's own layout (ErrorHandler.record_exception): its summary shows py_callstack.
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                     "timestamp": str(int(time.time()))}}}, handle)
        except OSError:
            error_file = None  # nobody else will show it: print it here
    if error_file and (os.environ.get(ERRORS_REPORTED_BY_LAUNCHER_ENV) == "1" or os.environ.get("RANK", "0") != "0"):
        return
    print(line, file=sys.stderr)


# An error line echoes what the user gave (a value, a path): one of 100 kB would bury the line's
# advice; past this, its middle is left out (the start names the key, the end says what to do).
MAX_ERROR_CHARS = 2000


def bounded(line: str) -> str:
    if len(line) <= MAX_ERROR_CHARS:
        return line
    left_out = len(line) - MAX_ERROR_CHARS
    return f"{line[:MAX_ERROR_CHARS // 2]}...[{left_out} characters left out]...{line[-MAX_ERROR_CHARS // 2:]}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = take_debug_flag(argv)
    quiet_torch_logs(debug)  # DTensor's advice to torch's developers, once per rank (triax.runtime.torch_logs)
    try:
        code = run_command(argv)
    except TriaxError as error:
        if debug:
            raise
        # One line whatever the message quotes: a control character in a path the user gave (a
        # newline, an escape sequence) is shown escaped, never printed raw.
        report_error(f"triax: error: {bounded(printable(str(error)))}")
        return 2
    except KeyboardInterrupt as interrupt:
        # The trainer's second Ctrl-C says where a restart will begin.
        print(f"triax: interrupted{'; ' + str(interrupt) if str(interrupt) else ''}", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
