"""Who am I and on which device: this process's place in the job.

Every door (trainer, Accelerator, horovod, pipe) asks this module for its place, so a process
started by torchrun, `triax launch`, Slurm's srun, OpenMPI/MPICH's mpirun, Horovod's own launcher
or as a plain `python script.py` finds its rank the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

from triax.errors import TriaxError
from triax.runtime.slurm import local_world_size

# Environment variables of each launcher, in the order they are trusted. torchrun comes first:
# `triax launch` is torchrun, and a torchrun started inside an Slurm allocation must win over Slurm's.
_LAUNCHERS = [
    # name, rank, world size, local rank, local world size
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
]


@dataclass(frozen=True)
class Place:
    """This process's position in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "single"  # which launcher's variables we read

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // max(self.local_world_size, 1)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0



def int_from_env(name: str, env: Mapping[str, str]) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    # Slurm writes SLURM_NTASKS_PER_NODE as e.g. "4(x2)"; the count before the bracket is ours.
    value = value.split("(")[0].split(",")[0]
    try:
        return int(value)
    except ValueError:
        raise TriaxError(f"environment variable {name}={env.get(name)!r} is not an integer") from None


def detect_place(env: Mapping[str, str] | None = None) -> Place:
    """Read rank and world size from whichever launcher started us; a plain process is rank 0 of 1."""
    env = os.environ if env is None else env
    for launcher, rank_var, world_var, local_var, local_world_var in _LAUNCHERS:
        rank, world = int_from_env(rank_var, env), int_from_env(world_var, env)
        if rank is None or world is None:
            continue
        if launcher == "slurm" and "SLURM_STEP_ID" not in env:
            continue  # inside an allocation but not started by srun: we are one plain process
        local = int_from_env(local_var, env)
        local_world = int_from_env(local_world_var, env)
        if launcher == "slurm":
            # SLURM_NTASKS_PER_NODE exists only with --ntasks-per-node; the step's own counts always do.
            local_world = local_world_size(env) or local_world
        if local is None:
            local = rank
        if local_world is None:
            local_world = world
        if not 0 <= rank < world:
            raise TriaxError(f"{rank_var}={rank} is outside 0..{world - 1} ({world_var}={world})")
        return Place(rank, world, local, local_world, launcher)
    return Place()


def pick_device(requested: str | None = None, local_rank: int = 0) -> torch.device:
    """`requested` ('cpu', 'cuda', 'cuda:1', 'auto' or None) -> the device this process uses.

    With several GPUs on a node, process `local_rank` takes GPU `local_rank`.
    """
    if requested in (None, "", "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TriaxError(f"device {requested!r} was asked for but CUDA is not available here; "
                             "use device=cpu (or install a CUDA build of torch)")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
