"""Is this machine, and this job's cluster, ready for the run its config describes? The checks of
`triax doctor` (triax.commands.doctor) and of a run's `trainer.preflight`.

Runs as one process or as every rank of a job (torchrun, `triax launch`, srun, mpirun). The ranks
first meet at the rendezvous store and form the process group (a rank that cannot is named, with
the address it could not reach); then each checks its own machine, the job measures its network,
and rank 0 prints one table and writes one JSON file. Exit code 1 when something a run needs
failed, 0 otherwise (warnings included), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from dataclasses import asdict
from typing import Callable, Protocol, TYPE_CHECKING

from triax.runtime.shared_decisions import all_gather_bytes, barrier, broadcast_int
from triax.doctor import network, report, storage, system
from triax.doctor.needs import RunNeeds
from triax.doctor.report import FAILED, OK, SKIPPED, Check
from triax.errors import ConfigError, TriaxError
from triax.runtime.place import Place, pick_device
from triax.runtime.precision import Precision
from triax.runtime.process_group import is_distributed
from triax.runtime.threads import apply_thread_choice
from triax.runtime.timeouts import collective_timeout, slow_phase_timeout
from triax.config import TrainConfig, to_dict

if TYPE_CHECKING:
    import torch

# Versions that must match on every rank: a mismatch fails collectives in ways that look like bugs.
SAME_EVERYWHERE = ("python", "torch", "triax", "cuda", "nccl")


# What a run needs (RunNeeds) from its config, process count and device: the trainer's pieces find the model's
# sizes (triax.train.needs.run_needs), so the caller hands that function in.
class NeedsOf(Protocol):
    def __call__(self, config: TrainConfig, world_size: int, *, device: torch.device) -> RunNeeds: ...


def preflight(config: TrainConfig, place: Place, device: torch.device, run_needs: NeedsOf) -> None:
    """trainer.preflight=true: the fast part of the doctor at the start of a run, on the run's own
    process group: memory, the snapshot directory (room, write rate, shared by every node) and the
    network (a 1 MiB all-reduce and all-gather, each link between nodes, stragglers). Leaves out
    what takes long (a compile) or what the run measures itself (the matmul rate, as MFU).
    Every rank raises together when something the run needs failed."""
    path = os.path.join(config.trainer.run_dir, "doctor.json")
    # `triax doctor --skip system --skip compile --sizes 1 --seconds 0.2 --json PATH`'s options
    args = argparse.Namespace(overrides=[], json=path, force=False, skip=["system", "compile"], store_timeout=60.0,
                              sizes=[2**20], link_mib=4.0, seconds=0.2, gpu_suite=False)
    if Doctor(config, args, place, run_needs, device).run():
        raise ConfigError(f"trainer.preflight: a check the run needs failed (the table above; the report is "
                          f"{path}); fix it, or set trainer.preflight=false to start anyway")


class Doctor:
    def __init__(self, config: TrainConfig, args: argparse.Namespace, place: Place, run_needs: NeedsOf,
                 device: torch.device | None = None):
        self.config, self.args, self.place, self.run_needs = config, args, place, run_needs
        self.skip = set(args.skip)
        self.device = device if device is not None else pick_device(config.trainer.device, place.local_rank)
        # `triax doctor` computes (matmuls, a compile) with the threads a run here would take
        # (triax.runtime.threads); a run's preflight keeps the run's own.
        self.threads = (apply_thread_choice(place.local_world_size)
                        if device is None and self.device.type == "cpu" else None)
        self.start = time.perf_counter()
        self.nodes = [network.Node(0, socket.gethostname(), "local", list(range(place.world_size)))]

    def run(self) -> int:
        joined = []
        if is_distributed():  # a run's preflight: its process group is formed already
            self.nodes = network.nodes_of_group(self.place)
        elif self.place.world_size > 1:
            joined = self._join()
        if any(check.status == FAILED for check in joined):
            return self._alone(joined)
        mine = [*joined, *self._local_checks()]
        for check in mine:
            check.rank = self.place.rank
        job, links = self._job_checks()
        everyone = all_gather_bytes(json.dumps([asdict(c) for c in mine]).encode()) if self.place.world_size > 1 \
            else [json.dumps([asdict(c) for c in mine]).encode()]
        code = 0
        if self.place.is_main:
            per_rank = [[Check(**item) for item in json.loads(payload)] for payload in everyone]
            checks = report.merge_ranks(per_rank) + job + self._same_versions(per_rank)
            self._publish(checks, links, self.args.json)
            code = int(report.worst(checks) == FAILED)
        return broadcast_int(code) if self.place.world_size > 1 else code

    # ---- the parts ----------------------------------------------------------------------------

    def _join(self) -> list[Check]:
        """Reach the store, wait for every rank, form the process group; stops at the first failure."""
        timeout = self.args.store_timeout
        store, check = network.reach_store(self.place, timeout)
        checks = [check]
        if store is None:
            return checks
        nodes, check = network.wait_for_ranks(store, self.place, timeout)
        checks.append(check)
        if not nodes:
            return checks
        self.nodes = nodes
        group_timeout = slow_phase_timeout(collective_timeout(self.config.trainer.collective_timeout))
        checks.append(network.form_group(self.device, self.place, store, group_timeout))
        return checks

    def _local_checks(self) -> list[Check]:
        config, checks = self.config, []
        trainer = config.trainer
        needs = None
        try:
            needs = self.run_needs(config, self.place.world_size, device=self.device)
            checks.append(Check("run", OK, f"{needs.shape.num_params() / 1e6:.1f}M parameters "
                                f"({config.model.name}), {needs.layout.describe()}, {trainer.precision}, "
                                f"batch {trainer.batch_size} x {needs.shape.block_size}", section="config"))
        except TriaxError as error:
            checks.append(Check("run", FAILED, str(error), "fix the configuration: `triax train` would stop here too",
                                "config"))
        if "system" in self.skip:
            checks.append(_skipped("system", "versions, device, precision, SDPA, matmul"))
        else:
            checks += _guarded("versions", system.versions)
            checks += _guarded("device", lambda: system.device_check(self.device, self.threads))
            checks += _guarded("precision", lambda: system.precision_check(self.device, trainer.precision))
            checks += _guarded("SDPA", lambda: system.attention_checks(
                self.device, Precision(trainer.precision).compute_dtype))
            checks += _guarded("matmul", lambda: system.matmul_checks(self.device, trainer.precision, self.args.seconds))
        if "compile" in self.skip:
            checks.append(_skipped("torch.compile", "a tiny compile"))
        else:
            checks += _guarded("torch.compile", lambda: system.compile_check(self.device, config.parallel.compile))
        if "memory" in self.skip:
            checks.append(_skipped("memory", "memory against the model's estimate"))
        elif needs is not None:
            checks += _guarded("memory", lambda: system.memory_checks(
                self.device, needs, trainer, config.parallel.cpu_offload, self.place.local_world_size))
        else:
            checks.append(_skipped("memory", "the run's config did not resolve (above)"))
        if "storage" in self.skip:
            checks.append(_skipped("storage", "snapshot directory"))
        elif needs is None:
            checks.append(_skipped("storage", "the run's config did not resolve (above)"))
        elif self.place.local_rank == 0:  # one per node: they share its disks
            checks += _guarded("snapshot space", lambda: storage.space_check(needs))
            checks += _guarded("snapshot write", lambda: storage.write_check(needs, self.place.rank))
        self.needs = needs
        return checks

    def _job_checks(self) -> tuple[list[Check], list[dict]]:
        """The collectives every rank takes part in; the findings are the same on every rank."""
        if self.place.world_size == 1:
            return [_skipped("network", "one process: no store, process group or links to check")], []
        checks, links = [], []
        if "network" in self.skip:
            checks.append(_skipped("network", "collective bandwidth, links, stragglers"))
        else:
            checks += network.job_bandwidth(self.args.sizes, self.args.seconds)
            if len(self.nodes) > 1:
                links = network.link_bandwidth(self.nodes, int(self.args.link_mib * 2**20), self.args.seconds)
            checks += network.link_checks(self.nodes, links)
            checks.append(network.straggler_check(self.device, self.nodes, self.args.seconds))
        if len(self.nodes) > 1 and "storage" not in self.skip:
            checks.append(self._shared_directory())
        return checks, links

    def _shared_directory(self) -> Check:
        needs = getattr(self, "needs", None)
        if needs is None:
            return _skipped("snapshot dir shared", "the run's config did not resolve")
        token = all_gather_bytes(storage.new_token().encode())[0].decode()
        node = next(node.index for node in self.nodes if self.place.rank in node.ranks)
        leader = self.place.rank == self.nodes[node].ranks[0]
        marker = storage.write_marker(needs, token, node) if leader else None
        barrier()
        seen = storage.markers_seen(needs, token, len(self.nodes)) if leader else []
        reports = all_gather_bytes(json.dumps(seen).encode())
        barrier()
        if marker is not None:
            os.remove(marker)
        seen_by_node = [json.loads(reports[each.ranks[0]]) for each in self.nodes]
        return storage.shared_check(needs, seen_by_node, [each.name for each in self.nodes])

    def _same_versions(self, per_rank: list[list[Check]]) -> list[Check]:
        if len(per_rank) == 1:
            return []
        found = {}
        for rank, checks in enumerate(per_rank):
            for check in checks:
                if check.name == "versions":
                    found[rank] = {key: check.values.get(key) for key in SAME_EVERYWHERE}
        if len(found) < 2:
            return []
        differing = sorted({key for key in SAME_EVERYWHERE if len({str(v[key]) for v in found.values()}) > 1})
        if not differing:
            return [Check("same versions", OK, f"{', '.join(SAME_EVERYWHERE)} equal on all {len(found)} ranks",
                          section="system")]
        words = "; ".join(f"{key}: " + ", ".join(f"rank {rank} {values[key]}" for rank, values in found.items())
                          for key in differing)
        return [Check("same versions", FAILED, words, "install the same versions on every node", "system")]

    def _alone(self, checks: list[Check]) -> int:
        """This rank could not join the others: its own report, its own file, exit 1."""
        for check in checks:
            check.rank = check.rank if check.rank is not None else self.place.rank
        path = self.args.json if self.place.is_main else report.rank_path(self.args.json, self.place.rank)
        self.nodes = []  # not known: the ranks never all met
        self._publish(checks, [], path)
        return 1

    def _publish(self, checks: list[Check], links: list[dict], path: str) -> None:
        seconds = time.perf_counter() - self.start
        lines = report.table(checks)
        nodes = f"{len(self.nodes)} node(s)" if self.nodes else "nodes not known"
        heading = (f"triax doctor: {self.place.world_size} process(es), {nodes}, "
                   f"device {self.device}" + (f", rank {self.place.rank}" if not self.place.is_main else ""))
        print(f"{heading}\n\n{lines}\n\n{report.summary(checks, seconds)}\nreport: {path}", flush=True)
        content = report.document(checks, world_size=self.place.world_size, links=links, seconds=seconds,
                                  nodes=[node.describe() for node in self.nodes], config=to_dict(self.config))
        try:
            report.write(path, content)
        except OSError as error:
            print(f"triax doctor: could not write {path}: {error.strerror or error}", flush=True)


def _guarded(name: str, make: Callable[[], Check | list[Check]]) -> list[Check]:
    """The check(s) `make` returns; one that raises (a broken driver, a bug) is a failed line of its
    own rather than a rank that dies while the others wait for it in the next collective.
    TRIAX_DEBUG=1 lets the exception through, with its traceback."""
    try:
        result = make()
    except Exception as error:
        if os.environ.get("TRIAX_DEBUG", "") not in ("", "0"):
            raise
        words = (str(error).strip().splitlines() or [""])[0]
        return [Check(name, FAILED, f"the check itself failed: {type(error).__name__}: {words}",
                      "run `TRIAX_DEBUG=1 triax doctor` on this node to see where, and report it", "doctor")]
    return result if isinstance(result, list) else [result]


def _skipped(name: str, what: str) -> Check:
    return Check(name, SKIPPED, f"not checked: {what}", section=name)

