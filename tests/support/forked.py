"""Start a test job's processes by forking a server that has imported triax once.

A fresh `python -m triax train` spends about 4 s of CPU importing torch, DTensor and DCP before
it runs a 3-step test model for under a second, and torchrun adds an agent that imports torch
too. On a 2-core machine that import time was most of the suite. Here a server process (our own,
not multiprocessing's forkserver, which would re-import pytest's main module in every child)
imports triax's trainer once per test session; every rank of every job is forked from it, gets exactly the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT), and runs the command
line as `python` would (`-m module ...` or `script.py ...`).

What it does not reproduce is torchrun's agent: restarts, its shared store, signal forwarding.
Tests of those (chaos, elastic restarts, the watchdog, launching itself) keep starting real
torchrun; tests that compare what the trainer computes in one layout with another use this.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from triax.runtime.rendezvous import free_port
from triax.testing import quiet_env

# Imported once, in the server, before any fork: what every trainer process needs.
PRELOAD = ["triax.commands.cli", "triax.commands.train", "triax.runs.reader", "triax.train.trainer", "triax.parallel",
           "triax.checkpoint", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch._dynamo"]


# ---- the server: a process that imported PRELOAD and forks one child per request -------------

def serve():
    """Read JSON requests on stdin ({"start": id, argv, env, cwd, out, err} or {"kill": id});
    write {"id", "pid"} when a child started and {"id", "exit"} when it ended. No threads here:
    the children are forked from this process."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    children = {}  # pid -> request id
    requests = sys.stdin.buffer
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:  # the test session ended: end whatever it left running
                for pid in children:
                    _kill(pid)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:
                    for pid, ident in children.items():
                        if ident == request["kill"]:
                            _kill(pid)
                    continue
                pid = os.fork()
                if pid == 0:
                    _rank(request["argv"], request["env"], request["cwd"], request["out"], request["err"])
                children[pid] = request["start"]
                _reply({"id": request["start"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reply(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _rank(argv, env, cwd, out_path, err_path):
    """One process of the job, in the forked child: the command line `python *argv` would run."""
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    # PYTHONPATH was read when the server started; the job's own entries go in front, as python would.
    sys.path[:0] = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    null = os.open(os.devnull, os.O_RDONLY)  # not the server's request pipe
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # Line-buffered, like PYTHONUNBUFFERED output interleaved by several ranks into one file.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os._exit(run_as_python(argv, env))


def run_as_python(argv, env):
    """In a forked child whose environment, directory and standard streams are set: run the
    command line `python *argv` would (`-m module ...` or `script.py ...`) and return its exit
    code, after what a normal interpreter exit does (atexit handlers, flushing)."""
    if env.get("OMP_NUM_THREADS", "").isdigit():
        # OpenMP read the variable when the server imported torch; a job may ask for another count.
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported like the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    # What a normal interpreter exit does (atexit handlers, logging's flush); the caller then
    # leaves with os._exit, without unwinding into the server's loop.
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - an exit handler's failure is reported, the exit code kept
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


# ---- the client, in the test process -----------------------------------------------------------

class _Server:
    def __init__(self):
        here = os.path.dirname(os.path.abspath(__file__))
        env = quiet_env()
        env["PYTHONPATH"] = os.pathsep.join([here, env["PYTHONPATH"]])
        self.process = subprocess.Popen([sys.executable, "-c", "import forked; forked.serve()"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.events = {}  # id -> {"pid": ..., "exit": ...}
        self.changed = threading.Condition()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.process.stdin.close)

    def _read(self):
        for line in self.process.stdout:
            message = json.loads(line)
            with self.changed:
                self.events.setdefault(message.pop("id"), {}).update(message)
                self.changed.notify_all()
        with self.changed:  # the server died: nothing will exit any more
            self.events[None] = {"dead": True}
            self.changed.notify_all()

    def _send(self, message):
        self.process.stdin.write((json.dumps(message) + "\n").encode())

    def start(self, argv, env, cwd, out, err):
        with self.changed:
            self.next_id += 1
            ident = self.next_id
        self._send({"start": ident, "argv": argv, "env": env, "cwd": cwd, "out": out, "err": err})
        return ident

    def kill(self, ident):
        self._send({"kill": ident})

    def wait(self, idents, timeout, stop_on_failure=True):
        """{id: exit code} once all ended, or once one failed (others None); None entries on timeout."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                if None in self.events:
                    raise RuntimeError("the test fork server died; its stderr is in the pytest output")
                codes = {ident: self.events.get(ident, {}).get("exit") for ident in idents}
                done = all(code is not None for code in codes.values())
                failed = any(code not in (None, 0) for code in codes.values())
                left = deadline - time.monotonic()
                if done or (failed and stop_on_failure) or left <= 0:
                    return codes
                self.changed.wait(min(left, 1.0))


_server = None


def launch(nproc: int, argv: list[str], timeout: float = 300, env: dict[str, str] | None = None,
           cwd: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `argv` as a job of `nproc` ranks (one plain process when nproc is 1); return its
    combined output like `triax.testing.run`. When a rank fails the others are stopped, as
    torchrun does; on failure with `check` raise with the output attached."""
    global _server
    if _server is None:
        _server = _Server()
    env = dict(env or quiet_env())
    port = free_port()
    description = f"forked {nproc} x python {' '.join(argv)}"
    with tempfile.TemporaryDirectory() as scratch:
        out_path, err_path = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        idents = []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0")
            idents.append(_server.start(argv, rank_env, cwd, out_path, err_path))
        codes = _server.wait(idents, timeout)
        unfinished = [ident for ident, code in codes.items() if code is None]
        for ident in unfinished:  # a rank failed, or time ran out: stop the rest, as torchrun does
            _server.kill(ident)
        if unfinished:
            codes.update({ident: code for ident, code in _server.wait(unfinished, 30, False).items()
                          if code is not None})
        stdout = open(out_path).read() if os.path.exists(out_path) else ""
        stderr = open(err_path).read() if os.path.exists(err_path) else ""
    exits = [codes[ident] for ident in idents]
    if all(code in (None, 0) for code in exits) and None in exits:
        raise subprocess.TimeoutExpired(description, timeout, output=stdout, stderr=stderr)
    returncode = next((code for code in exits if code not in (None, 0)), 0)
    if check and returncode != 0:
        raise AssertionError(f"{description} failed, exit codes {exits}\n"
                             f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
                             f"{_hang_reports(argv, cwd)}")
    return subprocess.CompletedProcess(description, returncode, stdout, stderr)


def _hang_reports(argv, cwd):
    """The watchdog's reports in the job's run directory (where it stopped, the stacks of every
    rank's threads), so that a failure in CI can be read from its output alone."""
    run_dirs = [arg.split("=", 1)[1] for arg in argv if arg.startswith("trainer.run_dir=")]
    text = ""
    for run_dir in run_dirs:
        run_dir = os.path.join(cwd or os.getcwd(), run_dir)
        for report in sorted(glob.glob(os.path.join(run_dir, "hang-*", "rank*.txt"))):
            with open(report, errors="replace") as handle:
                text += f"\n--- {report} ---\n{handle.read()[:6000]}"
    return text
