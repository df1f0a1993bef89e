"""`triax config`: write (by questions, or --default) or --show the launch configuration `triax
launch` takes its defaults from (the file and its checks: triax.launch.config)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Collection

import yaml

from triax.arguments import ArgumentParser
from triax.errors import TriaxError
from triax.launch.config import (ENV_CONFIG_FILE, RDZV_BACKENDS, LaunchConfig, check_config_file, config_path,
                                 default_config, load_config, write_config, written_by_triax)
from triax.launch.settings import MIXED_PRECISION_CHOICES, PARALLEL_CHOICES


def _ask(prompt: str, default: object, convert: Callable = str, choices: Collection | None = None) -> object:
    while True:
        shown = ("yes" if default else "no") if isinstance(default, bool) else default
        answer = input(f"{prompt} [{shown}]: ")
        if not sys.stdin.isatty():
            # Piped answers are not echoed by a terminal: write each, so every question ends its line.
            print(answer)
        answer = answer.strip()
        if not answer:
            return default
        try:
            value = convert(answer)
        except ValueError:
            print(f"  please answer with a {convert.__name__}")
            continue
        if choices and value not in choices:
            print(f"  please answer one of: {', '.join(map(str, choices))}")
            continue
        return value


def _yes_no(text: str) -> bool:
    if text.lower() in ("y", "yes", "true", "1"):
        return True
    if text.lower() in ("n", "no", "false", "0"):
        return False
    raise ValueError(text)


_yes_no.__name__ = "yes/no"


def ask_config(start: LaunchConfig) -> LaunchConfig:
    config = dataclasses.replace(start)
    config.num_machines = _ask("How many machines (nodes)?", config.num_machines, int)
    if config.num_machines > 1:
        config.machine_rank = _ask("Rank of this machine?", config.machine_rank, int,
                                   range(config.num_machines))
        ip = "" if config.main_process_ip == "127.0.0.1" else config.main_process_ip
        config.main_process_ip = _ask("IP address of machine 0?", ip or "10.0.0.1")
        config.rdzv_backend = _ask("Rendezvous backend?", config.rdzv_backend, str, RDZV_BACKENDS)
    else:
        config.machine_rank, config.main_process_ip = 0, "127.0.0.1"
    config.main_process_port = _ask("Rendezvous port (0 = pick a free one)?", config.main_process_port, int)
    config.num_processes = _ask("How many processes per machine?", config.num_processes, int)
    config.use_cpu = _ask("Use the CPU only (yes/no)?", config.use_cpu, _yes_no)
    config.mixed_precision = _ask("Mixed precision?", config.mixed_precision, str, MIXED_PRECISION_CHOICES)
    config.parallel = _ask("Parallel layout?", config.parallel, str, PARALLEL_CHOICES)
    config.gradient_accumulation_steps = _ask("Gradient accumulation steps?",
                                              config.gradient_accumulation_steps, int)
    config.max_restarts = _ask("Restarts after a worker failure?", config.max_restarts, int)
    return config.validate("answers")


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="triax config", description=(
        "Write the launch configuration `triax launch` takes its defaults from. "
        f"File: ${ENV_CONFIG_FILE}, else ~/.cache/triax/default_config.yaml."))
    parser.add_argument("--default", action="store_true", help="write the defaults without asking")
    parser.add_argument("--config-file", help="where to write (default: $TRIAX_CONFIG_FILE, else "
                                              "~/.cache/triax/default_config.yaml)")
    parser.add_argument("--show", action="store_true", help="print the active configuration and exit")
    parser.add_argument("--force", action="store_true", help="replace a --config-file triax did not write")
    args = parser.parse_args(argv)
    path = args.config_file if args.config_file is not None else config_path()  # "" is refused, not the default
    if not args.show:
        check_config_file(path, args.force)  # before any question is asked
    if args.show:
        config = load_config(path)
        if config is None:
            raise TriaxError(f"no configuration at {path}; run `triax config` or `triax config --default`")
        print(f"# {path}")
        print(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False), end="")
        return 0
    if args.default:
        config = default_config()
    else:
        # The questions start from the existing file's answers, so re-running edits it.
        start = (load_config(path) if written_by_triax(path) else None) or default_config()
        try:
            config = ask_config(start)
        except EOFError:
            raise TriaxError("triax config ran out of answers (end of input); answer the questions "
                             "in a terminal, or use `triax config --default`") from None
    written = write_config(config, path)
    print(f"configuration written to {written}")
    return 0
