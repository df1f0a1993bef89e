"""Run a torchrun job across simulated nodes: Linux network namespaces made by scripts/netns.sh,
joined through a bandwidth-limited link. Used by benchmarks/netns_compression.py and the tests.

Each node runs its own torchrun agent inside its namespace (`ip netns exec`); the agents meet by
torchrun's c10d rendezvous at node 0's address, so all traffic between nodes (rendezvous, the
process group's store, gloo/NCCL collectives) crosses the limited link.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from triax.errors import TriaxError
from triax.testing import quiet_env

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "scripts", "netns.sh")
RENDEZVOUS_PORT = 29477


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    if not os.path.exists(SCRIPT):
        return f"{SCRIPT} is missing (the simulated network needs a source checkout of triax)"
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    result = subprocess.run(["bash", SCRIPT, "check"], capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stdout + result.stderr).strip()


class SimulatedNetwork:
    """`with SimulatedNetwork(nodes=2, rate="100mbit") as net: net.torchrun([...])` — the
    namespaces exist only inside the block and are removed even when the block fails."""

    def __init__(self, nodes: int = 2, rate: str = "1gbit", delay: str | None = None,
                 prefix: str | None = None, subnet: str = "10.213.7"):
        self.nodes, self.rate, self.delay, self.subnet = nodes, rate, delay, subnet
        # A fresh prefix per network: two at once (tests beside a benchmark) do not collide.
        self.prefix = prefix or f"tx{uuid.uuid4().hex[:5]}"

    def _script(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["bash", SCRIPT, args[0], "--prefix", self.prefix, *args[1:]],
                                capture_output=True, text=True)
        if check and result.returncode != 0:
            raise TriaxError(f"netns.sh {' '.join(args)} failed: {(result.stderr or result.stdout).strip()}")
        return result

    def __enter__(self) -> "SimulatedNetwork":
        args = ["up", "--nodes", str(self.nodes), "--rate", self.rate, "--subnet", self.subnet]
        if self.delay:
            args += ["--delay", self.delay]
        self.up_message = self._script(*args).stdout.strip()
        return self

    def __exit__(self, *exc) -> None:
        self._script("down", check=False)

    def address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def torchrun_command(self, node: int, args: list[str], nproc_per_node: int = 1,
                         run_id: str = "triax", nnodes: str | None = None, max_restarts: int = 0,
                         rdzv_conf: str = "") -> list[str]:
        """`nnodes` e.g. "1:2" for an elastic job that may shrink; `rdzv_conf` extra key=value,..."""
        conf = f"is_host={1 if node == 0 else 0}" + (f",{rdzv_conf}" if rdzv_conf else "")
        return ["ip", "netns", "exec", self.namespace(node), sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={nnodes or self.nodes}", f"--nproc-per-node={nproc_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.address(0)}:{RENDEZVOUS_PORT}",
                f"--rdzv-id={run_id}", f"--rdzv-conf={conf}",
                f"--local-addr={self.address(node)}", f"--max-restarts={max_restarts}", *args]

    def cut_link(self, node: int) -> None:
        """Take node `node`'s link down: its peers get no reset, it just stops answering."""
        subprocess.run(["ip", "-n", self.namespace(node), "link", "set", "eth0", "down"], check=True)

    @staticmethod
    def environment(env: dict[str, str] | None = None) -> dict[str, str]:
        """Collectives must use the namespace's eth0, not whatever the host name resolves to."""
        env = dict(env or quiet_env())
        env.update(GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="eth0", TP_SOCKET_IFNAME="eth0")
        return env

    def torchrun(self, args: list[str], nproc_per_node: int = 1, timeout: float = 600,
                 env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
        """Start one torchrun agent per node and wait for all; raise with their output if any fails."""
        env = self.environment(env)
        run_id = uuid.uuid4().hex[:8]
        processes = [subprocess.Popen(self.torchrun_command(node, args, nproc_per_node, run_id),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for node in range(self.nodes)]
        deadline = time.monotonic() + timeout
        results = []
        try:
            for process in processes:
                stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
                results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
        except subprocess.TimeoutExpired:
            outputs = []
            for node, process in enumerate(processes):
                process.kill()
                stdout, stderr = process.communicate()
                outputs.append(f"--- node {node} ---\n{(stderr or stdout)[-1500:]}")
            raise TriaxError(f"the job on the simulated network did not finish in {timeout:.0f}s:\n"
                             + "\n".join(outputs)) from None
        failed = [(node, r) for node, r in enumerate(results) if r.returncode != 0]
        if failed:
            node, result = failed[0]
            raise TriaxError(f"node {node} of the simulated network failed (exit {result.returncode}):\n"
                             f"{(result.stderr or result.stdout)[-3000:]}")
        return results
