"""What the elastic driver (driver.py) and its workers (worker.py) say to each other.

They share one torch.distributed TCPStore, served by the driver. Time is cut into rounds: a round
is one fixed set of workers with one process group. When the set must change (a worker failed, or
the hosts changed and the workers stopped at a commit), each surviving worker says it is READY for
the next round; once every worker of the round is ready or gone, the driver decides the next
round's assignment and writes each ready worker's slot (or REMOVED), then starts workers for new
slots. Each round's process group meets under a key prefix of its own.

Host changes reach the workers as NOTICES: the driver appends one (the kind of change, Horovod's
HostUpdateResult flags) and rank 0 reads the new ones at every `state.commit()` /
`state.check_host_updates()`.
"""

from __future__ import annotations

# Horovod's names: every elastic worker of horovodrun sees these.
ELASTIC_ENV = "HOROVOD_ELASTIC"
ADDRESS_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_PORT"
TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"
# triax's: which worker this process is, the round it starts in, the notices already acted on.
WORKER_ENV = "TRIAX_HOROVOD_WORKER"
ROUND_ENV = "TRIAX_HOROVOD_ROUND"
NOTICES_ENV = "TRIAX_HOROVOD_NOTICES"

DEFAULT_ELASTIC_TIMEOUT_S = 600  # Horovod's default for --elastic-timeout

# Horovod's HostUpdateResult flags
NO_UPDATE, REMOVED, ADDED = 0, 1, 2

REMOVED_ANSWER = "removed"
NOTICE_COUNT_KEY = "elastic/notices"


def ready_key(round_number: int, worker: str) -> str:
    return f"elastic/ready/{round_number}/{worker}"


def assignment_key(round_number: int, worker: str) -> str:
    return f"elastic/assign/{round_number}/{worker}"


def notice_key(number: int) -> str:
    return f"elastic/notice/{number}"


def group_prefix(round_number: int) -> str:
    return f"elastic/group/{round_number}"
