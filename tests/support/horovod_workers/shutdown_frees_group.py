"""Started by test_horovod_api.py on 2 fresh processes (torchrun): after every hvd.shutdown() (and
at exit, for a script that ends without one, as Horovod's do) none of gloo's threads or connections
is left. Joins and leaves twice, as an elastic reset does, with a DistributedOptimizer step (its
collectives start during backward) and a plain allreduce each time, then ends joined.

Prints one line per look: "<when> threads=<n> gloo_sockets=<n>"."""

import atexit
import os

import torch


def threads() -> int:
    """This process's threads, less the rendezvous store's server (rank 0 serves it for the next
    hvd.init(); it is not gloo's)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                count += not handle.read().startswith("pt_tcpstore")
        except OSError:
            pass  # ended meanwhile
    return count


def gloo_sockets() -> int:
    """This process's TCP connections other than the rendezvous store's (MASTER_PORT): gloo's."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    store_port = int(os.environ["MASTER_PORT"])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                ports = {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
                if fields[9] in inodes and store_port not in ports:
                    count += 1
    return count


def look(when: str) -> None:
    # One write per line: both ranks share torchrun's stdout, and an unbuffered print() writes the
    # text and its newline separately, so two ranks' lines could run into each other.
    os.write(1, f"{when} threads={threads()} gloo_sockets={gloo_sockets()}\n".encode())


@atexit.register  # registered before hvd.init(), so it runs after every exit handler of triax
def at_exit():
    look("exit")


look("baseline")
import triax.horovod as hvd  # noqa: E402

for attempt in range(2):
    hvd.init()
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    hvd.allreduce(torch.ones(3), name=f"after step {attempt}")
    look(f"joined {attempt}")
    hvd.shutdown()
    look(f"left {attempt}")
hvd.init()
hvd.allreduce(torch.ones(3), name="last")
look("joined at the end")
