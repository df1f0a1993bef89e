"""The job's network: every rank reaches the rendezvous store, the process group forms on the
run's backend, and how fast collectives move bytes, over the whole job and between every pair of
nodes.

Bandwidths follow nccl-tests (NVIDIA's `all_reduce_perf`, `all_gather_perf`; their
doc/PERFORMANCE.md): for S bytes in t seconds the algorithm bandwidth is S / t, and the bus
bandwidth, the rate each rank's link actually carries and so comparable to the link's speed
whatever the number of ranks, is
  all-reduce  algbw x 2(n-1)/n   (a ring sends each byte out and back: 2(n-1)/n of S per rank)
  all-gather  algbw x (n-1)/n    (S is the gathered output; each rank receives (n-1)/n of it).
Between two nodes (n = 2) both equal algbw.

Node pairs are measured with one rank per node (the lowest on it), in rounds of disjoint pairs
(the circle method of a round-robin tournament), so N nodes take N - 1 rounds, not N(N-1)/2 tests,
and no two tests in a round share a node's link. A node's link is the best figure of its pairs (a
pair goes at its slower end's speed, so one fast peer is enough to see a node's own link).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from triax.runtime.shared_decisions import all_gather_bytes, barrier, gather_floats
from triax.doctor.report import FAILED, OK, SKIPPED, WARNING, Check, format_bytes, format_rate
from triax.runtime.collectives_at_exit import wait_and_keep
from triax.tracking.throughput import measure_peak_flops
from triax.runtime.place import Place, default_backend
from triax.runtime.process_group import collective_device, init_distributed, shutdown_distributed
from triax.runtime.rendezvous import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, attempt_store

SECTION = "network"
SLOWER_THAN_MEDIAN = 1.2  # a link or rank more than 20% slower than the median is named
MAX_ITERATIONS = 50
POLL_S = 0.1
VERDICT_GRACE_S = 15.0  # how long rank 0's verdict on missing ranks waits to be read


@dataclass
class Node:
    index: int
    host: str
    address: str
    ranks: list[int]

    @property
    def name(self) -> str:
        return f"node {self.index} ({self.host} {self.address})"

    def describe(self) -> dict:
        return {"node": self.index, "host": self.host, "address": self.address, "ranks": self.ranks}


def store_address() -> tuple[str, int]:
    """Where the job's store is: MASTER_ADDR:MASTER_PORT, as torchrun, `triax launch` and the
    rendezvous defaults (triax/runtime/rendezvous.py) set them."""
    address = os.environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
    port_text = os.environ.get("MASTER_PORT") or str(DEFAULT_MASTER_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"MASTER_PORT={port_text!r} is not a port number (1-65535)")
    return address, int(port_text)


def local_address(remote: str, port: int) -> str:
    """This host's address on the way to `remote` (the interface the kernel would route through);
    a UDP 'connect' sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((remote, port))
            return probe.getsockname()[0]
    except OSError:
        return "unknown address"


def reach_store(place: Place, timeout_s: float):
    """(the job's store seen through this attempt's prefix, or None; the finding). Rank 0 hosts the
    store unless torchrun's agent already does (TORCHELASTIC_USE_AGENT_STORE)."""
    try:
        address, port = store_address()
    except ValueError as error:
        return None, Check("store", FAILED, str(error), "set MASTER_PORT to the port of the job's store",
                           SECTION, place.rank)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts = not agent_store and place.rank == 0
    mine = local_address(address, port)
    start = time.perf_counter()
    try:
        store = dist.TCPStore(address, port, place.world_size, is_master=hosts, wait_for_workers=False,
                              timeout=_timedelta(timeout_s))
    except (RuntimeError, OSError, ValueError) as error:
        what = "cannot host the store on" if hosts else "cannot reach the store at"
        # torch's first sentence says it; later ones may quote an address it never initialised.
        words = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0].rstrip(".")
        return None, Check(
            "store", FAILED, f"rank {place.rank} ({socket.gethostname()} {mine}) {what} {address}:{port} "
            f"within {timeout_s:.0f} s: {words}",
            "check that this node can route to MASTER_ADDR (ping, firewall rules for the port) and that "
            "MASTER_ADDR/MASTER_PORT are the same on every node", SECTION, place.rank,
            values={"address": f"{address}:{port}", "local_address": mine})
    store = attempt_store(store, "triax-doctor")
    store.set(f"arrived/{place.rank}", json.dumps({"host": socket.gethostname(), "address": mine,
                                                   "local_rank": place.local_rank}))
    seconds = time.perf_counter() - start
    return store, Check("store", OK, f"rank {place.rank} reached {address}:{port} in {seconds:.2f} s", section=SECTION,
                        rank=place.rank, values={"address": f"{address}:{port}", "seconds": seconds})


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def wait_for_ranks(store: dist.Store, place: Place, timeout_s: float) -> tuple[list[Node], Check]:
    """Every rank's arrival in the store, or the ones missing by name once `timeout_s` is up.

    Rank 0 gives the verdict on who is missing, so every rank names the same ones, and keeps the
    store (which it hosts) up until the others have read it."""
    address, port = store_address()
    keys = [f"arrived/{rank}" for rank in range(place.world_size)]
    deadline = time.monotonic() + timeout_s
    missing = keys
    try:
        while True:
            missing = [key for key in keys if not store.check([key])]
            if not missing:
                break
            if place.rank == 0 and time.monotonic() >= deadline:
                store.set("verdict", json.dumps(missing))
                _wait_for_acknowledgements(store, [key for key in keys if key not in missing])
                break
            if place.rank != 0 and store.check(["verdict"]):
                missing = json.loads(store.get("verdict"))
                store.set(f"acknowledged/{place.rank}", "1")
                break
            if time.monotonic() >= deadline + VERDICT_GRACE_S:  # rank 0 is gone: this rank's own view
                break
            time.sleep(POLL_S)
        arrivals = {rank: _arrival(store.get(key)) for rank, key in enumerate(keys) if key not in missing}
    except (RuntimeError, OSError, ValueError) as error:
        return [], Check("ranks", FAILED, f"the store at {address}:{port} went away: {str(error).splitlines()[0]}",
                         "rank 0, which hosts it, stopped: look at its output first", SECTION, place.rank)
    if missing:
        ranks = [int(key.split("/")[1]) for key in missing]
        names = ", ".join(f"rank {rank}" for rank in ranks)
        return [], Check("ranks", FAILED, f"{names} did not reach the store at {address}:{port} within "
                         f"{timeout_s:.0f} s ({place.world_size - len(ranks)} of {place.world_size} did)",
                         "look at the missing ranks' own output: their node cannot route to MASTER_ADDR, "
                         "or they never started", SECTION, values={"missing_ranks": ranks})
    nodes: dict[tuple[str, str], Node] = {}
    for rank in range(place.world_size):
        key = (arrivals[rank]["host"], arrivals[rank]["address"])
        if key not in nodes:
            nodes[key] = Node(len(nodes), key[0], key[1], [])
        nodes[key].ranks.append(rank)
    found = list(nodes.values())
    return found, Check("ranks", OK, f"all {place.world_size} ranks arrived, on {len(found)} node(s)", section=SECTION)


def nodes_of_group(place: Place) -> list[Node]:
    """The nodes of a job whose process group already exists (a run's preflight): every rank's
    host and address, gathered (a collective)."""
    address, port = store_address()
    mine = json.dumps([socket.gethostname(), local_address(address, port)]).encode()
    nodes: dict[tuple[str, str], Node] = {}
    for rank, payload in enumerate(all_gather_bytes(mine)):
        host, where = json.loads(payload)
        nodes.setdefault((host, where), Node(len(nodes), host, where, [])).ranks.append(rank)
    return list(nodes.values())


def _arrival(payload: bytes) -> dict:
    """A rank's arrival record: its host and address as strings, whatever the store held."""
    try:
        record = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        record = None
    record = record if isinstance(record, dict) else {}
    return {key: str(record.get(key, "unknown"))[:256] for key in ("host", "address")}


def _wait_for_acknowledgements(store: dist.Store, arrived: list[str]) -> None:
    others = [f"acknowledged/{key.split('/')[1]}" for key in arrived if key != "arrived/0"]
    deadline = time.monotonic() + VERDICT_GRACE_S
    while others and time.monotonic() < deadline:
        others = [key for key in others if not store.check([key])]
        time.sleep(POLL_S)


def form_group(device: torch.device, place: Place, store: dist.Store, timeout_s: float) -> Check:
    backend = default_backend(device)
    start = time.perf_counter()
    try:
        init_distributed(device, place, backend=backend, timeout_s=timeout_s, store=dist.PrefixStore("group", store))
        barrier()
    except (RuntimeError, OSError, ValueError) as error:
        return Check("process group", FAILED, f"{backend} on rank {place.rank}: {str(error).splitlines()[0]}",
                     "for gloo set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for nccl) to the interface the nodes "
                     "share; for NCCL run with NCCL_DEBUG=INFO to see which transport failed", SECTION, place.rank)
    seconds = time.perf_counter() - start
    return Check("process group", OK, f"{backend}, {place.world_size} ranks, formed in {seconds:.2f} s",
                 section=SECTION, values={"backend": backend, "seconds": seconds})


def _iterations(seconds_one: float, target_s: float, group: dist.ProcessGroup | None = None) -> int:
    """How many timed repeats fill `target_s`, agreed by every rank of `group` (the slowest decides)."""
    wanted = torch.tensor([seconds_one], dtype=torch.float64, device=collective_device())
    wait_and_keep(dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return max(1, min(MAX_ITERATIONS, round(target_s / max(wanted.item(), 1e-6))))


def _synchronize() -> None:
    """Wait for the device: an NCCL work's wait() only orders the current CUDA stream, so the host
    would stop the clock before the bytes moved."""
    if collective_device().type == "cuda":
        torch.cuda.synchronize()


def _timed(operation: Callable[[], None], iterations: int, group: dist.ProcessGroup | None = None) -> float:
    """Seconds per `operation`, the slowest rank's (a collective ends when its last rank is done)."""
    wait_and_keep(dist.barrier(group=group, async_op=True))
    start = time.perf_counter()
    for _ in range(iterations):
        operation()
    _synchronize()
    seconds = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64,
                           device=collective_device())
    wait_and_keep(dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group, async_op=True))
    return seconds.item()


def _measure(kind: str, size_bytes: int, target_s: float, group: dist.ProcessGroup | None = None) -> dict:
    """One nccl-tests row: `kind` (all_reduce | all_gather) of `size_bytes` on `group`."""
    device = collective_device()
    n = dist.get_world_size(group)
    elements = max(n, size_bytes // 4 // n * n)
    if kind == "all_reduce":
        tensor = torch.ones(elements, dtype=torch.float32, device=device)

        def operation():
            wait_and_keep(dist.all_reduce(tensor, group=group, async_op=True))
        factor = 2 * (n - 1) / n
    else:
        output = torch.empty(elements, dtype=torch.float32, device=device)
        piece = torch.ones(elements // n, dtype=torch.float32, device=device)

        def operation():
            wait_and_keep(dist.all_gather_single(output, piece, group=group, async_op=True))
        factor = (n - 1) / n
    warm_start = time.perf_counter()
    operation()  # the first call sets up connections and buffers: not timed
    _synchronize()
    iterations = _iterations(time.perf_counter() - warm_start, target_s, group)
    seconds = _timed(operation, iterations, group)
    size = elements * 4
    algbw = size / seconds
    return {"collective": kind, "bytes": size, "ranks": n, "iterations": iterations, "seconds": seconds,
            "algbw": algbw, "busbw": algbw * factor}


def job_bandwidth(sizes: list[int], target_s: float) -> list[Check]:
    """All-reduce and all-gather over every rank of the job, at each size."""
    checks = []
    for kind in ("all_reduce", "all_gather"):
        for size in sizes:
            row = _measure(kind, size, target_s)
            label = kind.replace("_", "-")
            checks.append(Check(
                f"{label} {format_bytes(size)}", OK,
                f"bus {format_rate(row['busbw'])}, algorithm {format_rate(row['algbw'])}; "
                f"{row['ranks']} ranks, {1e3 * row['seconds']:.1f} ms each", section=SECTION, values=row))
    return checks


def round_robin(count: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair of `count` items once (the circle method)."""
    items = list(range(count)) + ([None] if count % 2 else [])
    rounds = []
    for _ in range(len(items) - 1):
        pairs = [(items[i], items[-1 - i]) for i in range(len(items) // 2)]
        rounds.append([tuple(sorted(pair)) for pair in pairs if None not in pair])
        items = [items[0], items[-1], *items[1:-1]]
    return rounds


def link_bandwidth(nodes: list[Node], size: int, target_s: float) -> list[dict]:
    """All-reduce between the lowest ranks of every pair of nodes; every rank calls this."""
    rank = dist.get_rank()
    rows = []
    for pairs in round_robin(len(nodes)):
        # new_group is itself a collective over the whole job: every rank makes every group.
        groups = {pair: dist.new_group([nodes[pair[0]].ranks[0], nodes[pair[1]].ranks[0]]) for pair in pairs}
        for pair, group in groups.items():
            if rank in (nodes[pair[0]].ranks[0], nodes[pair[1]].ranks[0]):
                row = _measure("all_reduce", size, target_s, group)
                rows.append({"nodes": list(pair), **row})
        barrier()  # the next round starts together: its tests must not overlap this one's
        # Each pair's group is used once: a run (preflight) or a large job must not keep N - 1
        # communicators per node (NCCL allocates buffers for each).
        for pair, group in groups.items():
            if rank in (nodes[pair[0]].ranks[0], nodes[pair[1]].ranks[0]):
                shutdown_distributed(group)
    # Every rank learns every pair's figures (only the pair's members measured them).
    fields = ("busbw", "algbw", "bytes", "seconds")
    table = {tuple(row["nodes"]): row for row in rows if rank == nodes[row["nodes"][0]].ranks[0]}
    pairs = [pair for pairs in round_robin(len(nodes)) for pair in pairs]
    mine = [float(table[pair][name]) if pair in table else 0.0 for pair in pairs for name in fields]
    everyone = gather_floats(mine)
    result = []
    for index, pair in enumerate(pairs):
        figures = [max(values[index * len(fields) + k] for values in everyone) for k in range(len(fields))]
        result.append({"nodes": list(pair), "ranks": [nodes[pair[0]].ranks[0], nodes[pair[1]].ranks[0]],
                       **dict(zip(fields, figures))})
    return result


def link_checks(nodes: list[Node], links: list[dict]) -> list[Check]:
    if len(nodes) < 2:
        return [Check("links", SKIPPED, "one node: no links between nodes to measure", section=SECTION)]
    # A node's own link: the best of its pairs (a pair runs at its slower end's speed).
    per_node = [max(link["busbw"] for link in links if node.index in link["nodes"]) for node in nodes]
    median = statistics.median(per_node)
    slowest = min(range(len(nodes)), key=per_node.__getitem__)
    slow_nodes = {index for index, value in enumerate(per_node)
                  if len(nodes) > 2 and value * SLOWER_THAN_MEDIAN < median}
    checks = []
    if len(nodes) <= 8:  # beyond, the pairs are in the JSON file and the table names the slowest
        for link in sorted(links, key=lambda link: link["nodes"]):
            a, b = (nodes[index] for index in link["nodes"])
            status = WARNING if slow_nodes & set(link["nodes"]) else OK
            checks.append(Check(f"link {a.index}-{b.index}", status, f"bus {format_rate(link['busbw'])}: {a.name} - {b.name}",
                                "goes at the speed of the slow node below", SECTION, values=link))
    if len(nodes) == 2:
        where = f"{nodes[0].name} - {nodes[1].name}"
        status, ratio = OK, 1.0
    else:
        where = nodes[slowest].name
        ratio = per_node[slowest] / median if median > 0 else 0.0
        status = WARNING if slowest in slow_nodes else OK
    figure = f"{where}: bus {format_rate(per_node[slowest])}"
    if len(nodes) > 2:
        figure += f", {ratio:.2f}x the median node link {format_rate(median)}"
    checks.append(Check("slowest link", status, figure,
                        "this node's link slows every collective of the run: check its cable/NIC speed "
                        "(ethtool), its switch port, and traffic from other jobs", SECTION,
                        values={"node": slowest, "busbw": per_node[slowest], "median_busbw": median,
                                "per_node_busbw": per_node}))
    return checks


def stragglers(rates: list[float]) -> tuple[float, list[int]]:
    """(the median rate, the ranks more than 20% slower than it: their time per matmul is over 1.2x
    the median's)."""
    median = statistics.median(rates)
    return median, [rank for rank, value in enumerate(rates) if value * SLOWER_THAN_MEDIAN < median]


def straggler_check(device: torch.device, nodes: list[Node], seconds: float) -> Check:
    """The same matmul timed on every rank at once; a rank more than 20% slower than the median is
    a straggler every step of the run will wait for."""
    dtype = torch.float32
    rate = measure_peak_flops(device, dtype, seconds=seconds)
    rates = [values[0] for values in gather_floats([rate])]
    median, slow = stragglers(rates)
    node_of = {rank: node for node in nodes for rank in node.ranks}
    values = {"flops_per_rank": rates, "median_flops": median, "stragglers": slow}
    if not slow:
        return Check("stragglers", OK, f"none: all {len(rates)} ranks within 20% of the median matmul rate "
                     f"{median / 1e9:.1f} GFLOP/s", section=SECTION, values=values)
    words = ", ".join(f"rank {rank} on {node_of[rank].name}: {rates[rank] / median:.2f}x the median" for rank in slow)
    return Check("stragglers", WARNING, f"{words} ({median / 1e9:.1f} GFLOP/s)",
                 "every step waits for the slowest rank: look for throttling, another job on that node, or "
                 "fewer CPU cores/threads there", SECTION, values=values)
