"""What `horovodrun` puts in every worker's environment, set before the worker's command starts.

Horovod's launcher gives each process HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK,
HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE and HOROVOD_HOSTNAME before the script
runs, and scripts (Horovod's own tests among them) read them before `hvd.init()`. `triax horovodrun`
has torchrun start `python -m triax.horovod.worker_env --slots 4,2 --hostname node1 -- COMMAND`:
this module turns torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK into Horovod's
names and then replaces itself with COMMAND (exec, so signals and the exit code are the command's).
"""

from __future__ import annotations

import argparse
import os
import sys

from triax.horovod.slots import assign


def horovod_variables(env, slots: list[int], hostname: str) -> dict[str, str]:
    """Horovod's variables for the worker torchrun described in `env`; `slots`: processes per host, in host order.

    Rank and sizes are torchrun's; the cross rank and size come from Horovod's placement (slots.py)."""
    local_rank, node = int(env["LOCAL_RANK"]), int(env["GROUP_RANK"])
    # Hosts are named by their index here: two entries may name the same machine.
    placed = next(info for info in assign([(str(h), count) for h, count in enumerate(slots)])
                  if info.hostname == str(node) and info.local_rank == local_rank)
    return {
        "HOROVOD_RANK": env["RANK"], "HOROVOD_SIZE": env["WORLD_SIZE"],
        "HOROVOD_LOCAL_RANK": env["LOCAL_RANK"], "HOROVOD_LOCAL_SIZE": env["LOCAL_WORLD_SIZE"],
        "HOROVOD_CROSS_RANK": str(placed.cross_rank), "HOROVOD_CROSS_SIZE": str(placed.cross_size),
        "HOROVOD_HOSTNAME": hostname,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m triax.horovod.worker_env")
    parser.add_argument("--slots", required=True, help="processes per host, comma-separated, in host order")
    parser.add_argument("--hostname", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run after --")
    os.environ.update(horovod_variables(os.environ, [int(s) for s in args.slots.split(",")], args.hostname))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
