"""`triax doctor` on simulated nodes (network namespaces joined by tc-limited links, scripts/netns.sh):
it measures every link between nodes, names the one slowed by tc with the rate tc set, and names a
rank that cannot reach the rendezvous store with the address it could not reach."""

import json
import os
import subprocess
import sys
import time

import pytest

from triax.bench.netns import RENDEZVOUS_PORT, SimulatedNetwork, unavailable_reason
from triax.testing import quiet_env

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=f"simulated network unavailable: {unavailable_reason()}")]

# The network section alone, quickly: the machine's own checks are tests/unit/doctor/test_doctor.py's.
# Three seconds per measurement: a link's 4 MiB all-reduce takes 0.67 s at 50 Mbit/s, so a second
# held one of them, and a stall of about 0.2 s in it (the length of one TCP retransmission timeout)
# put that figure 22% under the rate (4.86 MB/s, twice). Spread over four, such a stall is 8%.
FAST = ["--skip", "system", "--skip", "compile", "--skip", "memory", "--sizes", "1", "--seconds", "3",
        "--store-timeout", "40"]
# Bandwidth through tc's token bucket, carrying TCP/IP headers (about 3% of a 1500-byte frame)
# and gloo's own framing: the bound, 20% of the rate tc set.
TOLERANCE = 0.2


def _doctor_args(tmp_path, report):
    return ["-m", "triax", "doctor", *FAST, "--json", str(report), f"trainer.run_dir={tmp_path / 'run'}",
            "model=gpt-nano", "data.block_size=16"]


def _rate_bytes(rate: str) -> float:
    return float(rate.removesuffix("mbit")) * 1e6 / 8


def _within(measured: float, expected: float) -> bool:
    return abs(measured - expected) <= TOLERANCE * expected


def test_two_nodes_measure_their_link(tmp_path):
    report = tmp_path / "doctor.json"
    rate = "50mbit"
    with SimulatedNetwork(nodes=2, rate=rate) as network:
        results = network.torchrun(_doctor_args(tmp_path, report), timeout=300, env=quiet_env())
    content = json.loads(report.read_text())
    assert content["status"] in ("ok", "warning"), next(r.stdout for r in results if "triax doctor" in r.stdout)
    assert sorted(node["address"] for node in content["nodes"]) == [network.address(0), network.address(1)]
    (link,) = content["links"]
    assert _within(link["busbw"], _rate_bytes(rate)), (link, rate)
    checks = {check["name"]: check for check in content["checks"]}
    assert checks["process group"]["status"] == "ok" and "gloo" in checks["process group"]["figure"]
    assert checks["snapshot dir shared"]["status"] == "ok"  # one filesystem under both namespaces
    for name in ("all-reduce 1.0 MiB", "all-gather 1.0 MiB"):
        assert checks[name]["values"]["busbw"] > 0
    assert network.address(1) in checks["slowest link"]["figure"]


def test_three_nodes_name_the_slowed_link(tmp_path):
    report = tmp_path / "doctor.json"
    slow = "40mbit"
    with SimulatedNetwork(nodes=3, rate="1gbit") as network:
        network.set_rate(2, slow)
        results = network.torchrun(_doctor_args(tmp_path, report), timeout=300, env=quiet_env())
    table = next(r.stdout for r in results if "slowest link" in r.stdout)
    content = json.loads(report.read_text())
    assert len(content["links"]) == 3, content["links"]  # every pair of nodes
    slowest = next(check for check in content["checks"] if check["name"] == "slowest link")
    slowed_node = next(node["node"] for node in content["nodes"] if node["address"] == network.address(2))
    assert slowest["values"]["node"] == slowed_node, table
    assert slowest["status"] == "warning" and network.address(2) in slowest["figure"], table
    assert _within(slowest["values"]["busbw"], _rate_bytes(slow)), (slowest, table)
    # The pairs without the slowed node are not limited by it.
    fast = [link for link in content["links"] if slowed_node not in link["nodes"]]
    assert fast and all(link["busbw"] > 2 * _rate_bytes(slow) for link in fast), content["links"]
    assert f"slowest link" in table and network.address(2) in table


def _start_rank(network, node, rank, world, port, report, tmp_path):
    env = SimulatedNetwork.environment(quiet_env(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=network.address(0), MASTER_PORT=str(port)))
    command = ["ip", "netns", "exec", network.namespace(node), sys.executable,
               *_doctor_args(tmp_path, report)]
    command[command.index("40")] = "15"  # --store-timeout: the missing rank is waited for this long
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def test_a_rank_that_cannot_reach_the_store_is_named(tmp_path):
    # Started as srun or mpirun start ranks (RANK, WORLD_SIZE, MASTER_ADDR): no torchrun agent,
    # whose own rendezvous would already fail, between the doctor and the unreachable store.
    report = tmp_path / "doctor.json"
    port = RENDEZVOUS_PORT + 7
    with SimulatedNetwork(nodes=3, rate="1gbit") as network:
        network.cut_link(2)
        processes = [_start_rank(network, node, node, 3, port, report, tmp_path) for node in range(3)]
        deadline = time.monotonic() + 240
        outputs = []
        for process in processes:
            outputs.append(process.communicate(timeout=max(1, deadline - time.monotonic())))
    codes = [process.returncode for process in processes]
    assert codes == [1, 1, 1], (codes, outputs)
    store = f"{network.address(0)}:{port}"
    # The rank that cannot reach the store says so: its rank, its address, the store's address.
    alone = outputs[2][0]
    assert "rank 2" in alone and f"cannot reach the store at {store}" in alone, outputs[2]
    own = json.loads((tmp_path / "doctor.rank2.json").read_text())
    assert own["status"] == "failed" and own["checks"][0]["values"]["address"] == store
    # The others name it too, without hanging in a process group that cannot form.
    for stdout, _ in outputs[:2]:
        assert f"rank 2 did not reach the store at {store}" in stdout, outputs[0][1][-3000:]
    content = json.loads(report.read_text())
    ranks = next(check for check in content["checks"] if check["name"] == "ranks")
    assert ranks["status"] == "failed" and ranks["values"]["missing_ranks"] == [2]
