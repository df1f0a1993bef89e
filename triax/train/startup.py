"""The start of a `triax train` process: the checks that need this machine (its memory, the
snapshot place), made before any process group exists so a mistake is one message per rank and
never a hang in a collective; then the watchdog and the process group."""

from __future__ import annotations

import os
import weakref

import torch

from triax import checkpoint, safe_files
from triax.errors import ConfigError
from triax.models.config import GPTConfig
from triax.objectives.chunked_logits import logits_limit_mb
from triax.parallel.mesh import Layout
from triax.parallel.plan import ModelShape, check_memory
from triax.runtime.host_memory import host_memory_bytes
from triax.runtime.place import Place
from triax.runtime.process_group import init_distributed
from triax.runtime.timeouts import collective_timeout, slow_phase_timeout
from triax.runtime.watchdog import Watchdog
from triax.runs.directory import remove_if_empty
from triax.config.schema import TrainConfig


def check_device_memory(config: TrainConfig, model_config: GPTConfig, layout: Layout, device: torch.device,
                        place: Place, block_size: int) -> None:
    """A model, batch and context this device cannot hold stop here, before anything is
    allocated (triax plan's estimate, without the runtime), instead of swapping for hours."""
    trainer, parallel = config.trainer, config.parallel
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        memory, where = properties.total_memory, f"{device} ({properties.name})"
    else:
        memory = host_memory_bytes()
        processes = place.local_world_size
        where = "this host" if processes == 1 else f"each of this host's {processes} processes"
        memory = memory // processes if memory else None
    if memory is None:
        return
    shape = ModelShape.from_config(model_config, block_size=block_size)
    check_memory(shape, layout, memory / 2**30, where, batch_size=trainer.batch_size,
                 precision=trainer.precision, checkpointing=parallel.activation_checkpointing,
                 pp_schedule=parallel.pp_schedule, microbatches=parallel.pp_microbatches,
                 max_logits_mb=logits_limit_mb(parallel.max_logits_mb, device))


def check_snapshot_root(config: TrainConfig, root: str, resume: bool) -> None:
    """The place of the snapshots: never a planted link, and a start that neither resumes nor
    overwrites refuses a place that already holds a run."""
    trainer = config.trainer
    # `root` is triax.config.snapshot_root's: <run_dir>/snapshots when trainer.snapshot_dir is unset.
    if trainer.snapshot_dir is None and os.path.lexists(root):
        try:  # a planted link would send snapshot writes, prunes and overwrite's deletes elsewhere
            safe_files.real_directory(root)
        except safe_files.UnsafeFileError as error:
            raise ConfigError(f"{error}; or name the place explicitly with trainer.snapshot_dir") from None
    if not resume and not trainer.overwrite:
        existing = checkpoint.latest_snapshot(root)
        if existing is not None:
            raise ConfigError(
                f"trainer.resume=false but {root!r} already holds a run (newest snapshot "
                f"{existing}); resume it (trainer.resume=true), choose another trainer.run_dir, or add "
                "trainer.overwrite=true to delete its snapshots and start over")


def join_job(config: TrainConfig, place: Place, device: torch.device, owner: object,
             created_run_dir: bool) -> tuple[Place, Watchdog | None]:
    """The watchdog and the process group; returns this process's place in the group and the
    watchdog (None for a single process), which stops when `owner` (the Trainer) goes away."""
    trainer = config.trainer
    # The watchdog enforces trainer.collective_timeout on each step phase and names the rank a
    # hang waits for; the process group's own timeout covers the slow phases (start-up, snapshots).
    timeout = collective_timeout(trainer.collective_timeout)
    watchdog = None
    try:
        if place.world_size > 1:
            watchdog = Watchdog(trainer.run_dir, timeout, place.rank, place.world_size)
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # torchrun's store exists before the process group: a rank that never arrives
                # is named here instead of waited for inside init_process_group.
                watchdog.start()
        place = init_distributed(device, place, timeout_s=slow_phase_timeout(timeout))
        if watchdog is not None and not watchdog.started:
            watchdog.start()
        if watchdog is not None:
            # Stopped when this trainer goes away, even if the rest of __init__ fails and the
            # caller goes on: a forgotten watchdog would end the process later.
            weakref.finalize(owner, watchdog.stop)
    except Exception:
        if watchdog is not None:
            watchdog.stop()
        if created_run_dir and place.is_main:
            remove_if_empty(trainer.run_dir)
        raise
    return place, watchdog
