"""triax under a real Slurm: slurmctld and two slurmd nodes, each in a network namespace with its
own name and address (scripts/slurm_cluster.sh), jobs submitted with sbatch from the login node
exactly as examples/slurm/*.sbatch are written. Needs root, slurm-wlm and munge (CI installs them:
.ci/apt-packages.txt); elsewhere every test here skips with the reason.

One cluster serves the whole module; it is taken down (daemons, jobs, namespaces, files) however
the tests end."""

import os

import pytest

from helpers import assert_bitwise_equal, final_weights, tiny_overrides, train
from triax.bench.slurm_cluster import SlurmCluster, unavailable_reason

pytestmark = pytest.mark.multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples", "slurm")
REASON = unavailable_reason()
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def cluster():
    if REASON is not None:
        pytest.skip(f"no Slurm cluster can be made here: {REASON}")
    with SlurmCluster(nodes=2) as running:
        yield running


def _output(directory, job_id, name="triax-train"):
    path = os.path.join(directory, f"{name}-{job_id}.out")
    with open(path, errors="replace") as handle:
        return handle.read()


def _finished(cluster, job_id, directory, name="triax-train"):
    fields = cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, _output(directory, job_id, name))
    return fields


def test_srun_one_task_per_process_equals_one_node(cluster, tmp_path, tiny_corpus):
    """examples/slurm/train.sbatch as written: two nodes, no MASTER_ADDR, the tasks meet on node1."""
    overrides = tiny_overrides(tmp_path / "slurm", tiny_corpus)
    job = cluster.sbatch([os.path.join(EXAMPLES, "train.sbatch"), *overrides], cwd=str(tmp_path))
    fields = _finished(cluster, job, tmp_path)
    assert fields["NodeList"] == "node[1-2]"
    train(tiny_overrides(tmp_path / "one_node", tiny_corpus), nproc=2)
    assert_bitwise_equal(final_weights(tmp_path / "slurm"), final_weights(tmp_path / "one_node"))
