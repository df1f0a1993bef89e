"""The jobs of `triax bench` (triax.commands.bench): one torchrun job per process count, each
running triax.bench.worker with the step arguments as they were given."""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from triax.bench.worker import add_step_arguments
from triax.errors import TriaxError
from triax.testing import quiet_env, torchrun_command


def worker_arguments(args: argparse.Namespace) -> list[str]:
    """The step arguments, passed on to each worker as they were given."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_step_arguments(parser)
    argv = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if value is None or value is False:
            continue
        argv += [action.option_strings[0]] if value is True else [action.option_strings[0], str(value)]
    return argv


def run_job(nproc: int, args: argparse.Namespace, out_path: str) -> dict:
    command = torchrun_command(nproc, ["-m", "triax.bench.worker", *worker_arguments(args), "--out", out_path])
    env = quiet_env(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0 or not os.path.exists(out_path):
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise TriaxError(f"the {nproc}-process benchmark job failed (exit {result.returncode}); "
                         f"its last output:\n{tail}")
    with open(out_path) as handle:
        return json.load(handle)
