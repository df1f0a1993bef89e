"""What `triax horovodrun` does with its workers' output, as Horovod's launcher does.

Each worker writes its lines prefixed with its rank (`[1]<stdout>:...`, triax/launch/horovod_worker.py).
The launcher reads the processes it started (one torchrun or ssh per host; one process per
elastic worker) and writes every line on to its own stdout or stderr. With --output-filename DIR
it also writes each worker's lines, prefix and all, to DIR/rank.<N>/stdout and DIR/rank.<N>/stderr
(N padded with zeros to the digits of np - 1, so the names sort in rank order), as Horovod's gloo
launcher does, by triax's safe-file rules (triax/safe_files.py): a planted link (rank.N itself or a
file in it) is refused, never written through, and a FIFO there is refused at once. The `[N]<started>` line each worker sends first is consumed here: it is how the
launcher knows a worker started (--start-timeout).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, TextIO

from triax import safe_files
from triax.errors import TriaxError
from triax.horovod.horovodrun_options import DEFAULT_START_TIMEOUT_S, START_TIMEOUT_ENV
from triax.launch.horovod_worker import LINE_PREFIX, STARTED, chunks, lines

if TYPE_CHECKING:
    import subprocess

READERS_JOIN_S = 10.0  # a process the job left behind may hold a pipe open: do not wait on it for ever


class JobOutput:
    def __init__(self, directory: str | None, np: int):
        self.directory = directory
        self.width = len(str(max(np - 1, 0)))
        self.files: dict[tuple[int, str], object] = {}
        self.started: set[int] = set()
        self.readers: list[threading.Thread] = []
        self.lock = threading.Lock()
        if directory:
            # DIR is the user's own argument (a link they name is followed); what triax makes in
            # it is not: rank.N and its files are never links, and only regular files.
            self.directory = os.path.realpath(directory)
            try:
                safe_files.make_directory(self.directory)
            except OSError as error:
                raise TriaxError(f"--output-filename {directory}: cannot make the directory: "
                                 f"{error.strerror or error}") from None

    def open_rank(self, rank: int, append: bool = False) -> None:
        """Open rank `rank`'s files: emptied at the start of a job, as Horovod's; a worker started
        later in an elastic job with a rank an earlier one had appends to them."""
        if not self.directory:
            return
        folder = os.path.join(self.directory, f"rank.{rank:0{self.width}d}")
        try:
            safe_files.make_directory(folder)
            opened = {stream: safe_files.open_write(os.path.join(folder, stream), append)
                      for stream in ("stdout", "stderr")}
        except OSError as error:  # UnsafeFileError says what the path is; others, what failed
            raise TriaxError(f"--output-filename: {error if isinstance(error, TriaxError) else error.strerror}"
                             + ("" if isinstance(error, TriaxError) else f" ({folder})")) from None
        with self.lock:
            for stream in ("stdout", "stderr"):
                old = self.files.pop((rank, stream), None)
                if old is not None:
                    old.close()
                self.files[(rank, stream)] = opened[stream]

    def follow(self, process: subprocess.Popen) -> None:
        """Read `process`'s stdout and stderr (both pipes) until they close."""
        for pipe, terminal in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            reader = threading.Thread(target=self._read, args=(pipe, terminal), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _read(self, pipe: IO[bytes], terminal: TextIO) -> None:
        for line in lines(chunks(pipe.fileno())):
            marker = STARTED.match(line)
            if marker:
                with self.lock:
                    self.started.add(int(marker.group(1)))
                continue
            with self.lock:
                _write(terminal, line)
                match = LINE_PREFIX.match(line) if self.directory else None
                file = match and self.files.get((int(match.group(1)), match.group(2).decode()))
                if file:
                    file.write(line)
                    file.flush()
        pipe.close()

    def started_ranks(self) -> set[int]:
        with self.lock:
            return set(self.started)

    def close(self) -> None:
        """Wait for what is left in the pipes, then close the files."""
        for reader in self.readers:
            reader.join(READERS_JOIN_S)
        with self.lock:
            for file in self.files.values():
                file.close()
            self.files.clear()


def _write(terminal: TextIO, line: bytes) -> None:
    buffer = getattr(terminal, "buffer", None)
    try:
        if buffer is not None:
            terminal.flush()  # text written before stays before
            buffer.write(line)
            buffer.flush()
        else:  # a text-only stream (a notebook's)
            terminal.write(line.decode(errors="replace"))
            terminal.flush()
    except (OSError, ValueError):
        pass  # our stdout is gone: the job goes on, as the workers' own writes would


class StartWatch:
    """--start-timeout: every worker must say it started (output.py reads the line) within
    `seconds` of the launch, as horovodrun must start every process within it."""

    def __init__(self, seconds: int, hosts_by_rank: dict[int, str], output: JobOutput):
        self.seconds, self.hosts_by_rank, self.output = seconds, hosts_by_rank, output
        self.ranks = set(hosts_by_rank)
        self.began = time.monotonic()

    def check(self, ranks: list[int]) -> bool:
        """True once every rank of `ranks` started; TriaxError if the time is up before."""
        missing = sorted(set(ranks) - self.output.started_ranks())
        if not missing:
            return True
        if time.monotonic() - self.began < self.seconds:
            return False
        shown = ", ".join(f"rank {rank} on {self.hosts_by_rank[rank]}" for rank in missing[:8])
        shown += f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise TriaxError(f"timed out after {self.seconds}s waiting for the workers to start ({shown} did not); "
                         "check that every host is reachable and can run the command, or raise --start-timeout "
                         f"(default ${START_TIMEOUT_ENV} or {DEFAULT_START_TIMEOUT_S})")
