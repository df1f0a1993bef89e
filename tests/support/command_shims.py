"""The `triax` and `torchrun` that tests/e2e/test_documented_commands.py puts first on PATH.

A documented command runs as written, through bash; these two names resolve to small scripts that
run this file as a client. The client hands its command line, environment, directory and its
standard streams (the file descriptors themselves) to a server that imported triax and torch once
and forks the command from there, as tests/support/forked.py does for the trainer tests: a command starts
in a fraction of a second instead of spending ~4 s of CPU importing torch, which on a 2-core
machine was most of the time of ~60 documented commands. The exit code comes back to the client,
so bash sees what `triax` itself returned.

What differs from the real thing, on purpose and only here:

- `triax train` (alone or under torchrun) is scaled down, one of the two changes the harness makes
  to a command: MODEL_SHAPE and AT_MOST below. A documented run of 2,000 steps of gpt2 trains here 6
  steps of a 2-layer, 32-wide model (a run of 500, 5; beside model.init_from the checkpoint's shape); every
  other key (data, layout, precision, init_from, resume...) is the page's.
- `torchrun` is parsed by torchrun's own argument parser, then its ranks are forked with the
  environment torchrun gives them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on loopback...),
  without torchrun's agent: no restarts, no signal forwarding. What only the agent does is tested
  with the real torchrun elsewhere (test_fault_tolerance.py, test_launch.py). One machine only: a
  command naming several is marked `needs:` in its page and never comes here.
- `triax launch` without a port of its own gets `--main-process-port 0` (a free port): its default,
  29500, would collide between two test sessions on one machine (the other change; PORT_OPTIONS).
- Commands started from inside a command (`triax launch` starts torchrun, which starts python) are
  the real programs.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

SERVER_VARIABLE = "TRIAX_DOCS_SERVER"  # the server's socket path, in the commands' environment

# `triax train` in the pages trains for minutes; here every run is at most 4 steps of a tiny model
# on small batches, with an evaluation (of 2 batches) and a text sample on the way, so every path a
# page shows (evaluation, sampling, snapshots, resume) still runs. Model shape keys are replaced
# (model.init_from replaces them anyway with the checkpoint's); the others are capped: a page's
# smaller value is kept (for eval_batches, 0 means the whole split: the largest).
MODEL_SHAPE = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32}
AT_MOST = {"trainer.max_steps": 4, "trainer.eval_every": 2, "trainer.eval_batches": 2, "trainer.batch_size": 8,
           "trainer.sample_tokens": 16, "data.block_size": 32}
# A longer run keeps some of its length (steps // 100, at most 6), so a page's later command that
# trains a run further (trainer.max_steps=600 after 300) still trains here instead of finding the
# run complete.
MAX_STEPS_CEILING = 6


def capped(key: str, value: int) -> int:
    if key == "trainer.eval_batches" and value == 0:  # the whole split: the largest
        return AT_MOST[key]
    if key == "trainer.max_steps" and value > AT_MOST[key]:
        return min(MAX_STEPS_CEILING, max(AT_MOST[key], value // 100))
    return min(value, AT_MOST[key])


# `triax launch` on one machine (a command for several is marked `needs:` and not run here) without
# a port of its own gets port 0, a free one: the default, torchrun's 29500, is one port for the whole
# machine, and two test sessions sharing it would collide there (refused as busy, or worse).
PORT_OPTIONS = ("--main-process-port", "--main_process_port")


def scaled(args: list[str]) -> list[str]:
    """The arguments of `triax train` with SCALE applied (nothing changes for --help)."""
    if "-h" in args or "--help" in args:
        return list(args)
    out, capped_keys = [], set()
    # Beside model.init_from the checkpoint decides the shape (a torchtitan folder's head count is
    # the page's own key): the model keys stay as written.
    starts_from_checkpoint = any(arg.lstrip("+~").startswith("model.init_from=") for arg in args)
    shape = {} if starts_from_checkpoint else MODEL_SHAPE
    for arg in args:
        key, equals, value = arg.partition("=")
        bare = key.lstrip("+~")
        if equals and bare in shape:
            continue  # replaced below
        if equals and bare in AT_MOST and value.isdigit():
            arg = f"{key}={capped(bare, int(value))}"
            capped_keys.add(bare)
        out.append(arg)
    out += [f"{key}={value}" for key, value in shape.items()]
    return out + [f"{key}={value}" for key, value in AT_MOST.items() if key not in capped_keys]


def _python_argv(kind: str, args: list[str]) -> tuple[list[str], int, str | None]:
    """(what `python` would run, ranks, an error) for a `triax` or `torchrun` command line. In the
    server: torchrun's parser needs torch."""
    if kind == "triax":
        if args[:1] == ["train"]:
            args = ["train", *scaled(args[1:])]
        if args[:1] == ["launch"] and not any(arg.split("=")[0] in PORT_OPTIONS for arg in args):
            args = ["launch", "--main-process-port", "0", *args[1:]]
        return ["-m", "triax", *args], 1, None
    from torch.distributed.run import get_args_parser

    try:
        parsed = get_args_parser().parse_args(args)
    except SystemExit as done:  # torchrun's own usage error, already printed to our stderr
        return [], 0, f"torchrun: exit {done.code}"
    if str(parsed.nnodes) not in ("1", "1:1") or parsed.no_python:
        return [], 0, (f"torchrun {' '.join(args)}: this test runs one machine and python ranks only; "
                       "mark the command `needs: several machines` in its page")
    script_args = list(parsed.training_script_args)
    if parsed.module and parsed.training_script == "triax" and script_args[:1] == ["train"]:
        script_args = ["train", *scaled(script_args[1:])]
    argv = ["-m", parsed.training_script, *script_args] if parsed.module else [parsed.training_script, *script_args]
    return argv, int(parsed.nproc_per_node), None


# ---- the server ---------------------------------------------------------------------------------

def serve(path: str) -> None:
    """Listen on `path` until stdin closes (the test session ended); fork each request's ranks."""
    import importlib
    import select
    import signal

    import forked
    from triax.runtime.rendezvous import free_port

    for name in [*forked.PRELOAD, "torch.distributed.run"]:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".starting")
    listener.listen(16)
    os.rename(path + ".starting", path)  # the path appears once connections are accepted
    jobs: dict[socket.socket, dict] = {}  # connection -> {"pids": {pid: exit or None}}

    def kill(job):
        for pid, code in job["pids"].items():
            if code is None:
                try:
                    os.killpg(pid, signal.SIGKILL)  # the rank and whatever it started
                except ProcessLookupError:
                    pass

    def finish(conn, code):
        try:
            conn.sendall(json.dumps({"exit": code}).encode())
        except OSError:
            pass
        conn.close()
        del jobs[conn]

    while True:
        readable, _, _ = select.select([sys.stdin, listener, *jobs], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            for job in jobs.values():
                kill(job)
            return
        if listener in readable:
            conn, _ = listener.accept()
            request, fds = _receive(conn)
            argv, ranks, error = _python_argv(request["kind"], request["args"])
            if error:
                os.write(fds[2], (error + "\n").encode())
            port = free_port()
            pids = {}
            for rank in range(ranks):
                env = dict(request["env"])
                if request["kind"] == "torchrun":
                    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                               LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", ROLE_RANK=str(rank),
                               ROLE_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in jobs:
                        other.close()
                    conn.close()
                    _child(argv, env, request["cwd"], fds)
                pids[pid] = None
            for fd in fds:
                os.close(fd)
            jobs[conn] = {"pids": pids}
            if not pids:
                finish(conn, 2)
        for conn in [conn for conn in readable if conn in jobs]:
            if not conn.recv(1):  # the client is gone (killed by a timeout): so is its command
                kill(jobs[conn])
                jobs[conn]["gone"] = True
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
            for conn, job in list(jobs.items()):
                if pid in job["pids"]:
                    job["pids"][pid] = code
                    if code != 0:
                        kill(job)  # as torchrun does: one rank failed, the others are stopped
                    codes = list(job["pids"].values())
                    if None not in codes:
                        finish(conn, next((c for c in codes if c != 0), 0))


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = struct.unpack("!Q", data[:8])[0]
    data = data[8:]
    while len(data) < size:
        data += conn.recv(size - len(data))
    return json.loads(data), list(fds)


def _child(argv: list[str], env: dict, cwd: str, fds: list[int]) -> None:
    import forked

    code = 1
    try:
        os.setpgid(0, 0)  # one group per rank: a timeout kills what the rank started too
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:0] = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep)
                        if entry and entry not in sys.path]
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        code = forked.run_as_python(argv, env)
    finally:
        os._exit(code)


# ---- the client: what `triax` and `torchrun` run ------------------------------------------------

def client(kind: str, args: list[str]) -> int:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(os.environ[SERVER_VARIABLE])
    payload = json.dumps({"kind": kind, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(connection, [struct.pack("!Q", len(payload)) + payload], [0, 1, 2])
    reply = b""
    while chunk := connection.recv(4096):
        reply += chunk
    if not reply:
        print(f"{kind}: the test's command server went away", file=sys.stderr)
        return 1
    return json.loads(reply)["exit"]


def write_shims(directory: str) -> None:
    """`triax` and `torchrun` in `directory`, each running this file's client."""
    for kind in ("triax", "torchrun"):
        path = os.path.join(directory, kind)
        with open(path, "w") as handle:
            handle.write(f'#!/bin/sh\nexec "{sys.executable}" -S "{os.path.abspath(__file__)}" {kind} "$@"\n')
        os.chmod(path, 0o755)


if __name__ == "__main__":
    sys.exit(client(sys.argv[1], sys.argv[2:]))
