"""A real Slurm cluster for tests and benchmarks: munge, slurmctld and N slurmd nodes, each in a
network namespace of its own (scripts/slurm_cluster.sh). Jobs are submitted from the login node
exactly as a user would (`sbatch script.sbatch ...`), and the daemons, jobs and namespaces are
gone when the block ends, whatever happened inside it.

    with SlurmCluster(nodes=2) as cluster:
        job = cluster.sbatch(["examples/slurm/train.sbatch", "trainer.max_steps=10"])
        cluster.wait(job, timeout=300)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Iterable

from triax.errors import TriaxError
from triax.testing import quiet_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "slurm_cluster.sh")
# States after which a job runs no more (squeue's long names).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE"}
# Variables of an allocation around this process (a test run inside sbatch) that must not leak
# into the simulated cluster's jobs.
_FOREIGN = re.compile(r"^(SLURM_|SLURMD_|SBATCH_|SRUN_|SALLOC_|MASTER_ADDR$|MASTER_PORT$|RANK$|WORLD_SIZE$|"
                      r"LOCAL_RANK$|LOCAL_WORLD_SIZE$|TORCHELASTIC_)")


def unavailable_reason() -> str | None:
    """Why a cluster cannot be made here (not root, packages missing), or None if it can."""
    if not os.path.exists(SCRIPT):
        return f"{SCRIPT} is missing (the cluster needs a source checkout of triax)"
    result = subprocess.run(["bash", SCRIPT, "check"], capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stdout + result.stderr).strip()


class SlurmCluster:
    def __init__(self, nodes: int = 2, cpus: int = 4, subnet: str = "10.214.9"):
        self.nodes, self.cpus, self.subnet = nodes, cpus, subnet
        self.directory: str | None = None

    def __enter__(self) -> "SlurmCluster":
        self.directory = tempfile.mkdtemp(prefix="triax-slurm-")
        try:
            self._script("up", "--nodes", str(self.nodes), "--cpus", str(self.cpus), "--subnet", self.subnet)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.directory is None:
            return
        subprocess.run(["bash", SCRIPT, "down", "--dir", self.directory], capture_output=True, text=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None

    def _script(self, command: str, *args: str) -> str:
        result = subprocess.run(["bash", SCRIPT, command, "--dir", self.directory, *args],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise TriaxError(f"slurm_cluster.sh {command} failed: {(result.stderr or result.stdout).strip()}"
                             f"{self._logs_tail()}")
        return result.stdout

    def _logs_tail(self) -> str:
        logs = os.path.join(self.directory or "", "log")
        if not os.path.isdir(logs):
            return ""
        tails = []
        for name in sorted(os.listdir(logs)):
            if name.endswith(".log"):
                with open(os.path.join(logs, name), errors="replace") as handle:
                    tails.append(f"--- {name} ---\n" + "".join(handle.readlines()[-8:]))
        return "\n" + "\n".join(tails)

    # ---- commands on the login node ---------------------------------------------------------

    def environment(self, **extra: str) -> dict[str, str]:
        """What a user's shell on the login node holds: this checkout on PYTHONPATH, SLURM_CONF."""
        env = {key: value for key, value in quiet_env().items() if not _FOREIGN.match(key)}
        env["SLURM_CONF"] = os.path.join(self.directory, "slurm.conf")
        env.update(extra)
        return env

    def command(self, args: list[str]) -> list[str]:
        """`args` as run on the login node (its network, hostname and /etc/hosts)."""
        return ["bash", SCRIPT, "exec", "--dir", self.directory, *args]

    def run(self, args: list[str], timeout: float = 120, env: dict[str, str] | None = None,
            cwd: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(self.command(args), capture_output=True, text=True, timeout=timeout,
                                env=env or self.environment(), cwd=cwd)
        if check and result.returncode != 0:
            raise TriaxError(f"{' '.join(args)} on the login node failed (exit {result.returncode}): "
                             f"{(result.stderr or result.stdout)[-3000:]}")
        return result

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> int:
        """Submit a batch job (`sbatch --parsable ARGS`) and return its id."""
        output = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip()
        return int(output.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as {field: value} (JobState, Restarts, ExitCode, NodeList, ...)."""
        text = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, states: Iterable[str] = frozenset(ENDED), timeout: float = 300,
             poll_s: float = 0.5) -> dict[str, str]:
        """Wait until the job is in one of `states`; its fields. Raises with the logs on a timeout."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise TriaxError(f"job {job_id} is {fields.get('JobState')} after {timeout:.0f} s, not one of "
                                 f"{sorted(states)}{self._logs_tail()}")
            time.sleep(poll_s)

    def wait_for_file(self, path: str, pattern: str, timeout: float = 300, job_id: int | None = None) -> str:
        """Wait until `path` holds a line matching `pattern` (a job's output, a log); the match.
        With `job_id`, give up at once if the job ends first."""
        deadline, compiled = time.monotonic() + timeout, re.compile(pattern)
        while True:
            if os.path.exists(path):
                with open(path, errors="replace") as handle:
                    found = compiled.search(handle.read())
                if found:
                    return found.group(0)
            if job_id is not None and self.job(job_id).get("JobState") in ENDED:
                raise TriaxError(f"job {job_id} ended before {pattern!r} appeared in {path}")
            if time.monotonic() > deadline:
                raise TriaxError(f"{pattern!r} did not appear in {path} within {timeout:.0f} s")
            time.sleep(0.3)

    # ---- the nodes ---------------------------------------------------------------------------

    def on_node(self, node: int, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run `args` on compute node `node` (1-based, as in node1)."""
        return subprocess.run(["bash", SCRIPT, "node", "--dir", self.directory, str(node), *args],
                              capture_output=True, text=True, timeout=timeout, env=self.environment())

    def lose_node(self, node: int) -> None:
        """Node `node` dies: its slurmd and every process on it are killed at once, no goodbye."""
        self._script("kill-node", str(node))

    def revive_node(self, node: int) -> None:
        """Node `node` boots again: a fresh slurmd, and the controller may use it again."""
        self._script("revive-node", str(node))
