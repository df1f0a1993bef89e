"""Run a torchrun job across simulated nodes: Linux network namespaces made by scripts/netns.sh,
joined through a bandwidth-limited link. Used by benchmarks/netns_compression.py and the tests.

Each node runs its own torchrun agent inside its namespace (`ip netns exec`); the agents meet by
torchrun's c10d rendezvous at node 0's address, so all traffic between nodes (rendezvous, the
process group's store, gloo/NCCL collectives) crosses the limited link.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
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

    def __exit__(self, *exc: object) -> None:
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

    def set_rate(self, node: int, rate: str) -> None:
        """Change node `node`'s outgoing rate (one slow link in an otherwise fast network); the
        queue settings are netns.sh's."""
        subprocess.run(["ip", "netns", "exec", self.namespace(node), "tc", "qdisc", "change", "dev", "eth0",
                        "root", "handle", "1:", "tbf", "rate", rate, "burst", "256kb", "latency", "200ms"],
                       check=True, capture_output=True)

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
        """Start one torchrun agent per node and wait for all; raise with their output if any fails.

        A node that fails leaves the others waiting in a collective for the process group's
        timeout (minutes): they get FAILURE_GRACE_S to finish, then every node's whole process
        tree (agent and workers, one session each) is killed, as when time runs out."""
        env = self.environment(env)
        run_id = uuid.uuid4().hex[:8]
        with tempfile.TemporaryDirectory() as scratch:
            outputs = [(open(os.path.join(scratch, f"{node}.out"), "w+"), open(os.path.join(scratch, f"{node}.err"), "w+"))
                       for node in range(self.nodes)]
            processes = [subprocess.Popen(self.torchrun_command(node, args, nproc_per_node, run_id), stdout=out,
                                          stderr=err, text=True, env=env, start_new_session=True)
                         for node, (out, err) in enumerate(outputs)]
            timed_out = _wait_or_kill(processes, time.monotonic() + timeout)
            results = []
            for process, (out, err) in zip(processes, outputs):
                out.seek(0)
                err.seek(0)
                results.append(subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read()))
                out.close()
                err.close()
        if timed_out:
            raise TriaxError(f"the job on the simulated network did not finish in {timeout:.0f}s:\n"
                             + "\n".join(f"--- node {node} ---\n{(r.stderr or r.stdout)[-1500:]}"
                                         for node, r in enumerate(results)))
        # The node that failed first, not one killed afterwards for waiting on it.
        failed = sorted(((r.returncode == -signal.SIGKILL, node, r) for node, r in enumerate(results)
                         if r.returncode != 0), key=lambda item: item[:2])
        if failed:
            _, node, result = failed[0]
            raise TriaxError(f"node {node} of the simulated network failed (exit {result.returncode}):\n"
                             f"{(result.stderr or result.stdout)[-3000:]}")
        return results


FAILURE_GRACE_S = 30.0


def _wait_or_kill(processes: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every node; kill all once time runs out or FAILURE_GRACE_S after one failed.
    True if time ran out."""
    failed_at = None
    while any(process.poll() is None for process in processes):
        now = time.monotonic()
        if failed_at is None and any(process.returncode not in (None, 0) for process in processes):
            failed_at = now
        if now >= deadline or (failed_at is not None and now - failed_at >= FAILURE_GRACE_S):
            for process in processes:
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, signal.SIGKILL)  # the agent and its workers
                    except ProcessLookupError:
                        pass
            for process in processes:
                process.wait()
            return failed_at is None
        time.sleep(0.1)
    return False
