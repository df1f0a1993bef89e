"""Starting and stopping `triax horovodrun`'s processes, here or on another host over ssh.

Remote starts are built so no host, option or value can be read as something else: the host
follows `--` in ssh's argv; every remote word is quoted; environment values travel on ssh's stdin,
not on any command line (where `ps` would show them); host-key checking is left to the user's ssh
configuration (`--ssh-option` passes options through).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from triax.runtime import slurm
from triax.horovod.hosts import address_of

if TYPE_CHECKING:
    import argparse

# Variables handed to remote hosts (horovodrun forwards the environment the same way).
FORWARDED_PREFIXES = ("HOROVOD_", "TRIAX_", "NCCL_", "GLOO_", "PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The remote shell reads the environment and the command from stdin, so neither is on a command line.
_REMOTE_SHELL = "sh -c 'eval \"$(cat)\"'"
STOP_GRACE_S = 10.0
# Horovod's words when a job ends because a worker failed (its tests and its users match the first
# sentence), on one line: the first process to fail as Horovod names it, and its exit code.
FAILURE_MESSAGE = ("Horovod detected that one or more processes exited with non-zero status, thus causing the job "
                   "to be terminated. The first process to do so was: Process name: {name} Exit code: {code}")


def forwarded_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a remote start exports: ours with a forwarded prefix, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.update(extra or {})
    return {k: v for k, v in env.items() if _ENV_NAME.match(k)}


def remote_start(host: str, argv: list[str], args: argparse.Namespace,
                 extra_env: dict[str, str] | None = None) -> tuple[list[str], str]:
    """(ssh argv, script for its stdin). The script sets the environment and runs the command.
    `args`: ssh_option (list), ssh_port, ssh_identity_file. A node of the Slurm allocation this
    runs in is reached by srun instead (a job step: triax.runtime.slurm.step_command), with the same script."""
    exports = "".join(f"export {name}={shlex.quote(value)}\n"
                      for name, value in forwarded_environment(extra_env).items())
    script = f"cd {shlex.quote(os.getcwd())} || exit 1\n{exports}exec {shlex.join(argv)}\n"
    allocation = slurm.allocation_hosts(os.environ) or []
    if host in {name for name, _ in allocation}:
        return slurm.step_command(host, ["sh", "-c", 'eval "$(cat)"']), script
    ssh = ["ssh"]
    for option in args.ssh_option:
        ssh += ["-o", option]
    if args.ssh_port:
        ssh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        ssh += ["-i", args.ssh_identity_file]
    user, at, _ = host.rpartition("@")
    ssh += ["--", user + at + address_of(host), _REMOTE_SHELL]  # ssh takes IPv6 addresses bare
    return ssh, script


def worker_command(command: list[str], timestamp: bool, *options: str) -> list[str]:
    """The command that starts one worker: triax.launch.horovod_worker (Horovod's variables under torchrun,
    the rank before each line of output), then the user's command."""
    return [sys.executable, "-m", "triax.launch.horovod_worker", *options, *(["--timestamp"] if timestamp else []),
            "--", *command]


def start(argv: list[str], script: str | None = None, env: dict[str, str] | None = None,
          pipes: bool = False) -> subprocess.Popen:
    """Start `argv` in a session of its own (stopping it stops everything it started); `script`
    goes to its stdin (a remote start); with `pipes`, its stdout and stderr are pipes (output.py reads them)."""
    output = subprocess.PIPE if pipes else None
    process = subprocess.Popen(argv, stdin=subprocess.PIPE if script is not None else None, env=env,
                               stdout=output, stderr=output, start_new_session=True)
    if script is not None:
        process.stdin.write(script.encode())
        process.stdin.close()
    return process


def stop(processes: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process group still running, then SIGKILL what outlives the grace period."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
