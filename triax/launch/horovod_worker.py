"""The first process of every worker of `triax horovodrun`, on the worker's host.

    python -m triax.launch.horovod_worker [--hostname H --cross 0:2,0:2,0:1] [--timestamp] -- COMMAND

Horovod's launcher reads each worker's output and writes it on line by line, each line prefixed
with the worker's rank and stream (`[1]<stdout>:loss 0.25`; with --prefix-output-with-timestamp
the time comes first, as time.asctime() writes it). triax's workers are started by torchrun or
by the elastic driver, so this process does it beside each worker. It
1. under torchrun (--hostname and --cross given), sets Horovod's variables from torchrun's;
2. says the worker started: one line on stdout, `[RANK]<started>`, that the launcher consumes
   (it counts them against --start-timeout);
3. runs COMMAND with its stdout and stderr through pipes and writes each line prefixed, in one
   write (the workers of a host share one stream, so a last line without an end gets one);
4. ends as COMMAND ended: its exit code, or the signal that ended it.
Signals it gets (torchrun and the launcher signal the worker's process group) are passed on to
COMMAND's process group once; COMMAND is killed if this process dies.

It lives as long as the worker, one per worker, so it imports nothing heavy (no torch, nothing
of triax.horovod): the launcher side (triax/horovod/output.py) uses its formats from here.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable, Mapping, TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

# [RANK]<stdout>: / [RANK]<stderr>:, optionally after time.asctime()'s text (which has no '[')
LINE_PREFIX = re.compile(rb"^[^\[\r\n]*\[(\d+)\]<(stdout|stderr)>:")
STARTED = re.compile(rb"^\[(\d+)\]<started>\r?\n?$")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
LONGEST_LINE = 1 << 16  # a line without an end this long is written out in pieces, each prefixed
_PR_SET_PDEATHSIG = 1


def prefix(rank: int, stream: str, timestamp: bool) -> bytes:
    """Horovod's prefix (horovod/runner/common/util/safe_shell_exec.py)."""
    when = time.asctime(time.localtime()) if timestamp else ""
    return f"{when}[{rank}]<{stream}>:".encode()


def started_line(rank: int) -> bytes:
    return f"[{rank}]<started>\n".encode()


def lines(chunks: Iterable[bytes]):
    """Split a byte stream into lines ending in \\n or \\r (a progress bar's update is a line, as
    in Horovod); the last piece may have no end."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        while True:
            ends = [i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0]
            if ends:
                cut = min(ends) + 1
            elif len(pending) >= LONGEST_LINE:
                cut = LONGEST_LINE
            else:
                break
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending


def chunks(fd: int):
    while True:
        data = os.read(fd, 65536)
        if not data:
            return
        yield data


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def horovod_variables(env: Mapping[str, str], cross: list[tuple[int, int]], hostname: str) -> dict[str, str]:
    """Horovod's variables for the worker torchrun described in `env`; `cross`: (cross rank, cross
    size) of each local rank on this host, worked out by the launcher (triax.horovod.slots)."""
    cross_rank, cross_size = cross[int(env["LOCAL_RANK"])]
    return {"HOROVOD_RANK": env["RANK"], "HOROVOD_SIZE": env["WORLD_SIZE"],
            "HOROVOD_LOCAL_RANK": env["LOCAL_RANK"], "HOROVOD_LOCAL_SIZE": env["LOCAL_WORLD_SIZE"],
            "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": str(cross_size),
            "HOROVOD_HOSTNAME": hostname}


def _forward(source: int, target: int, head: Callable[[], bytes]) -> None:
    """Copy `source` to `target` line by line, each line after head(); if `target` is gone (the
    launcher died), keep reading so the command never blocks on a full pipe. A piece without an
    end (the last, or one LONGEST_LINE long) gets a newline: the workers of a host share one
    stream, so another worker's line must not continue it."""
    alive = True
    for line in lines(chunks(source)):
        if alive:
            try:
                write_all(target, head() + (line if line.endswith((b"\n", b"\r")) else line + b"\n"))
            except OSError:
                alive = False
    os.close(source)


def _die_with_parent(parent: int):
    def set_up() -> None:  # runs in the child before exec
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    return set_up


def run(command: list[str], rank: int, timestamp: bool) -> int:
    """Run `command` with prefixed output; its return code (negative: the signal that ended it)."""
    write_all(1, started_line(rank))
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # as Horovod: output reaches the pipe as it is written
    try:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))
    except OSError as error:
        write_all(2, prefix(rank, "stderr", timestamp) + f"cannot start {command[0]}: {error.strerror}\n".encode())
        return 127

    def pass_on(signum: int, frame: FrameType | None):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, pass_on)
    readers = [threading.Thread(target=_forward, args=(pipe.fileno(), target, lambda s=stream: prefix(rank, s, timestamp)))
               for pipe, target, stream in ((child.stdout, 1, "stdout"), (child.stderr, 2, "stderr"))]
    for reader in readers:
        reader.start()
    code = child.wait()
    for reader in readers:
        reader.join()
    return code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m triax.launch.horovod_worker")
    parser.add_argument("--hostname", help="under torchrun: the host's name in the host list")
    parser.add_argument("--cross", help="under torchrun: cross rank:cross size of each local rank")
    parser.add_argument("--timestamp", action="store_true", help="put the time before each line's prefix")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run after --")
    if args.cross is not None:
        cross = [tuple(int(n) for n in pair.split(":")) for pair in args.cross.split(",")]
        os.environ.update(horovod_variables(os.environ, cross, args.hostname))
    code = run(command, int(os.environ["HOROVOD_RANK"]), args.timestamp)
    if code < 0:  # end the way the command ended, so torchrun and the driver see the signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is not to end the process: the shell's number
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
