"""triax under a real Slurm: slurmctld and three slurmd nodes (the jobs take two; the third lets a
job requeued after losing a node start again), each in a network namespace with its own name and
address (scripts/slurm_cluster.sh); jobs are submitted with sbatch from the login node exactly as
examples/slurm/*.sbatch are written. Needs root, slurm-wlm and munge (CI installs them:
.ci/apt-packages.txt); elsewhere every test here skips with the reason.

One cluster serves the whole module; it is taken down (daemons, jobs, namespaces, files) however
the tests end."""

import os
import re
import subprocess
import sys

import pytest

from support.helpers import assert_bitwise_equal, final_weights, tiny_overrides, train
from triax.bench.slurm_cluster import SlurmCluster, unavailable_reason
from support import REPO_DIR

pytestmark = pytest.mark.multiprocess

REPO = REPO_DIR
EXAMPLES = os.path.join(REPO, "examples", "slurm")
REASON = unavailable_reason()
JOB_TIMEOUT = 240
# Rank 0 says why the run stopped: the signal, when it reached rank 0 first, else another rank's.
STOPPED = r"stopped by (SIG[A-Z0-9]+|a signal on another rank) after step"


@pytest.fixture(scope="module")
def cluster():
    if REASON is not None:
        pytest.skip(f"no Slurm cluster can be made here: {REASON}")
    with SlurmCluster(nodes=3) as running:
        yield running


def _leftovers(directory):
    """Processes of a cluster in `directory` (its daemons name their files there)."""
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in processes.splitlines() if directory in line]


def test_the_cluster_is_taken_down_when_the_block_fails():
    if REASON is not None:
        pytest.skip(f"no Slurm cluster can be made here: {REASON}")
    cluster = SlurmCluster(nodes=2)
    with pytest.raises(RuntimeError, match="job failed"):
        with cluster:
            directory = cluster.directory
            with open(os.path.join(directory, "prefix")) as handle:
                prefix = handle.read().strip()
            assert cluster.run(["sinfo", "-h", "-o", "%D %t"]).stdout.split() == ["2", "idle"]
            assert any(directory in line for line in _leftovers(directory))  # its daemons are running
            raise RuntimeError("job failed")
    assert not os.path.exists(directory) and not _leftovers(directory)
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


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
    assert fields["NumNodes"] == "2", fields
    train(tiny_overrides(tmp_path / "one_node", tiny_corpus), nproc=2)
    assert_bitwise_equal(final_weights(tmp_path / "slurm"), final_weights(tmp_path / "one_node"))


def _long_run(run_dir, tiny_corpus, **extra):
    """Long enough that a signal sent after step 10 lands mid-run, even on a fast machine."""
    return tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": 300, "trainer.log_every": 5,
                                                   "trainer.save_every": 0, **extra})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_corpus):
    """The final weights of _long_run on one node, two processes, never stopped."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(_long_run(run_dir, tiny_corpus), nproc=2)
    return final_weights(run_dir)


def test_preemption_signal_requeues_and_resumes_bitwise(cluster, tmp_path, tiny_corpus, uninterrupted):
    """--signal=B:USR1@N fires (sent here at once: the timer may fire 60 s early anyway): the batch
    script passes USR1 to the step, triax snapshots and exits 0, the script requeues the job, and
    the requeued job ends bitwise equal to an uninterrupted run."""
    overrides = _long_run(tmp_path / "slurm", tiny_corpus)
    job = cluster.sbatch([os.path.join(EXAMPLES, "train.sbatch"), *overrides], cwd=str(tmp_path))
    output = os.path.join(tmp_path, f"triax-train-{job}.out")
    cluster.wait_for_file(output, r"step (1[05]|2\d)/300", timeout=JOB_TIMEOUT, job_id=job)
    cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
    fields = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=JOB_TIMEOUT)
    text = _output(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, text)
    assert "received SIGUSR1" in text and re.search(STOPPED, text) and "requeueing job" in text, text
    assert "(restart 1)" in text, text
    assert_bitwise_equal(final_weights(tmp_path / "slurm"), uninterrupted)


def test_scontrol_requeue_mid_run_resumes_bitwise(cluster, tmp_path, tiny_corpus, uninterrupted):
    """An administrator's `scontrol requeue`: SIGTERM to every step, a clean stop with a snapshot,
    and the job starts again (same id) and ends bitwise equal to an uninterrupted run."""
    overrides = _long_run(tmp_path / "slurm", tiny_corpus)
    job = cluster.sbatch([os.path.join(EXAMPLES, "train.sbatch"), *overrides], cwd=str(tmp_path))
    output = os.path.join(tmp_path, f"triax-train-{job}.out")
    cluster.wait_for_file(output, r"step (1[05]|2\d)/300", timeout=JOB_TIMEOUT, job_id=job)
    cluster.run(["scontrol", "requeue", str(job)])
    cluster.wait_for_file(output, r"\(restart 1\)", timeout=JOB_TIMEOUT)
    fields = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=JOB_TIMEOUT)
    text = _output(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, text)
    assert "received SIGTERM" in text and re.search(STOPPED, text), text
    assert re.search(r"resuming from \S+: step [1-9]\d*/300", text), text
    assert_bitwise_equal(final_weights(tmp_path / "slurm"), uninterrupted)


def test_scancel_stops_cleanly_with_a_snapshot(cluster, tmp_path, tiny_corpus):
    """scancel sends SIGTERM to the step: every rank stops after the same step, the snapshot is
    written and verified, and the output says where a restart begins."""
    from triax import checkpoint
    from support.helpers import run_snapshot_root

    overrides = _long_run(tmp_path / "slurm", tiny_corpus)
    job = cluster.sbatch([os.path.join(EXAMPLES, "train.sbatch"), *overrides], cwd=str(tmp_path))
    output = os.path.join(tmp_path, f"triax-train-{job}.out")
    cluster.wait_for_file(output, r"step (1[05]|2\d)/300", timeout=JOB_TIMEOUT, job_id=job)
    cluster.run(["scancel", str(job)])
    fields = cluster.wait(job, timeout=JOB_TIMEOUT)
    text = _output(tmp_path, job)
    assert fields["JobState"] == "CANCELLED", (fields, text)
    stopped = [line for line in text.splitlines() if re.search(STOPPED, line)]
    assert "received SIGTERM" in text, text
    assert stopped and "start the same command again to resume from it" in stopped[0], text
    snapshot = checkpoint.latest_snapshot(run_snapshot_root(tmp_path / "slurm"))
    assert snapshot is not None and str(snapshot) in stopped[0], (snapshot, stopped)
    checkpoint.read_model_tensors(snapshot)  # verified against its manifest


def test_triax_launch_per_node_equals_one_node_and_a_signal_stop_exits_0(cluster, tmp_path, tiny_corpus):
    """examples/slurm/launch.sbatch: one torchrun agent per node (triax launch), 2 workers each,
    machines and address from Slurm; equals 4 processes on one node. Then the same job stopped by
    SIGTERM to its step (what scancel and scontrol requeue send): every level exits 0."""
    overrides = tiny_overrides(tmp_path / "slurm", tiny_corpus)
    job = cluster.sbatch([os.path.join(EXAMPLES, "launch.sbatch"), "-m", "triax", "train", *overrides], cwd=str(tmp_path))
    _finished(cluster, job, tmp_path, "triax-launch")
    train(tiny_overrides(tmp_path / "one_node", tiny_corpus), nproc=4)
    assert_bitwise_equal(final_weights(tmp_path / "slurm"), final_weights(tmp_path / "one_node"))

    job = cluster.sbatch([os.path.join(EXAMPLES, "launch.sbatch"), "-m", "triax", "train", *_long_run(tmp_path / "stopped", tiny_corpus)],
                         cwd=str(tmp_path))
    output = os.path.join(tmp_path, f"triax-launch-{job}.out")
    cluster.wait_for_file(output, r"step (1[05]|2\d)/300", timeout=JOB_TIMEOUT, job_id=job)
    cluster.run(["scancel", "--signal=TERM", str(job)])  # the steps only: the job is not cancelled
    _finished(cluster, job, tmp_path, "triax-launch")
    text = _output(tmp_path, job, "triax-launch")
    assert re.search(STOPPED, text) and text.count("triax launch: stopped by SIGTERM; all 2 workers exited 0") == 2, text


def _weight_sum(text):
    found = re.findall(r"weight sum (\S+)", text)
    assert len(found) == 1, text
    return float(found[0])


def test_accelerator_and_horovod_doors_on_two_nodes(cluster, tmp_path):
    """The Accelerator started by srun directly (2 tasks) and by triax launch in srun (2 nodes x 2),
    a triax.horovod script started by srun and by triax horovodrun with the allocation's hosts (no -H):
    each ends where one process does. The jobs share
    the nodes (one CPU per task), so they run at once."""
    jobs = {
        "accelerator/srun": (cluster.sbatch([os.path.join(EXAMPLES, "srun.sbatch"),
                                             os.path.join(EXAMPLES, "accelerator_example.py")], cwd=str(tmp_path)),
                             "triax-srun", "accelerator_example.py", "2 processes"),
        "horovod/srun": (cluster.sbatch([os.path.join(EXAMPLES, "srun.sbatch"),
                                         os.path.join(EXAMPLES, "horovod_example.py")], cwd=str(tmp_path)),
                         "triax-srun", "horovod_example.py", "2 processes"),
        "accelerator/launch": (cluster.sbatch([os.path.join(EXAMPLES, "launch.sbatch"),
                                               os.path.join(EXAMPLES, "accelerator_example.py")], cwd=str(tmp_path)),
                               "triax-launch", "accelerator_example.py", "4 processes"),
        "horovod/horovodrun": (cluster.sbatch([os.path.join(EXAMPLES, "horovodrun.sbatch"),
                                               os.path.join(EXAMPLES, "horovod_example.py")], cwd=str(tmp_path)),
                               "triax-horovodrun", "horovod_example.py", "2 processes"),
    }
    alone = {}
    for script in ("accelerator_example.py", "horovod_example.py"):
        result = subprocess.run([sys.executable, os.path.join(EXAMPLES, script)], capture_output=True, text=True,
                                timeout=120, env=cluster.environment(), check=True)
        alone[script] = _weight_sum(result.stdout)
    for door, (job, name, script, processes) in jobs.items():
        _finished(cluster, job, tmp_path, name)
        text = _output(tmp_path, job, name)
        assert processes in text, (door, text)
        # float64, a global batch split in 2 or 4: the sums differ from one process's by round-off only.
        assert _weight_sum(text) == pytest.approx(alone[script], rel=1e-12, abs=1e-12), (door, text)


def test_a_lost_node_ends_the_step_and_the_requeued_job_resumes_bitwise(cluster, tmp_path, tiny_corpus, uninterrupted):
    """A node dies mid-run (its slurmd and every process on it killed at once, after the snapshot of
    step 20): Slurm names the node and requeues the job (--requeue), which runs on the nodes left,
    resumes from the newest complete snapshot and ends bitwise equal to an uninterrupted run."""
    overrides = _long_run(tmp_path / "slurm", tiny_corpus, **{"trainer.save_every": 20})
    job = cluster.sbatch([os.path.join(EXAMPLES, "train.sbatch"), *overrides], cwd=str(tmp_path))
    output = os.path.join(tmp_path, f"triax-train-{job}.out")
    cluster.wait_for_file(output, r"step (2[5-9]|3\d)/300", timeout=JOB_TIMEOUT, job_id=job)
    lost = int(cluster.job(job)["NodeList"].rstrip("]").split("-")[-1].split(",")[-1])  # its last node
    cluster.lose_node(lost)
    try:
        fields = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=JOB_TIMEOUT)
    finally:
        cluster.revive_node(lost)
    text = _output(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", (fields, text)
    assert f"Node failure on node{lost}" in text, text
    # The ranks left say it too, naming the node (its address resolves through the nodes' /etc/hosts).
    assert f"(node{lost}) closed" in text, text
    assert re.search(r"resuming from \S+step_\d+: step [1-9]\d*/300", text), text
    assert_bitwise_equal(final_weights(tmp_path / "slurm"), uninterrupted)


def test_a_step_with_fewer_tasks_than_the_layout_is_one_line(cluster, tmp_path, tiny_corpus):
    """srun -n2 for a layout of 4: every task says so in one line and the step ends at once."""
    overrides = tiny_overrides(tmp_path / "run", tiny_corpus, **{"parallel.dp_shard": 4})
    result = cluster.run(["srun", "--nodes=2", "--ntasks=2", "--kill-on-bad-exit=1", "python", "-m", "triax", "train",
                          *overrides], cwd=str(tmp_path), check=False, timeout=JOB_TIMEOUT)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("triax: error:")]
    assert errors and all("the world size 2 is not divisible by 4" in line for line in errors), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
