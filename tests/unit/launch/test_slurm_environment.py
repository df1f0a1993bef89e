"""What triax reads from a Slurm allocation, without a cluster: node lists in Slurm's hostlist
syntax, the rendezvous every task derives alike, the tasks on a node, and hostile values
(each one line). The real cluster's tests are in test_slurm_cluster.py."""

import contextlib
import os
import random
import socket
import subprocess
import sys

import pytest

from support.helpers import tiny_overrides, train
from triax.errors import TriaxError
from triax.runtime.place import detect_place
from triax.runtime.rendezvous import RendezvousError, set_rendezvous_defaults
from triax.testing import quiet_env
from triax.runtime.slurm import (
    MAX_HOSTS,
    SLURM_FIRST_PORT,
    SLURM_PORT_SPAN,
    expand_nodelist,
    first_host,
    rendezvous_address,
    tasks_per_node,
)
from support import REPO_DIR

REPO = REPO_DIR


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[1-3,5],other", ["node1", "node2", "node3", "node5", "other"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a[3],b.example.org,c_1[0-1]", ["a3", "b.example.org", "c_10", "c_11"]),
])
def test_node_lists_expand_as_slurm_writes_them(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist, says", [
    ("node[1-3", "never closed"),
    ("node1-3]", "without '['"),
    ("node[[1-2]]", "nested"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "not a number"),
    ("node[]", "not a number"),
    ("node1,,node2", "empty host name"),
    ("node1 node2", "cannot have"),
    ("-oProxyCommand=x", "starts with '-'"),  # never an option to srun, ssh or torchrun
    ("node1,-x", "starts with '-'"),
    ("nöde1", "cannot have"),
    ("node[1-2]]", "without"),
    ("", "is empty"),
    ("n[0-99999999999]", f"at most {MAX_HOSTS}"),
    ("n" * (2 << 20), "characters long"),
])
def test_a_node_list_that_cannot_be_read_is_one_line(nodelist, says):
    with pytest.raises(TriaxError) as caught:
        first_host(nodelist, "SLURM_JOB_NODELIST")
    assert says in str(caught.value)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


def test_every_task_of_a_step_derives_the_same_rendezvous():
    base = {"SLURM_JOB_ID": "123457", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    addresses = set()
    for rank in range(4):
        env = {**base, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank // 2), "SLURM_LOCALID": str(rank % 2)}
        set_rendezvous_defaults("slurm", env)
        addresses.add((env["MASTER_ADDR"], env["MASTER_PORT"]))
        place = detect_place(env)
        assert (place.rank, place.world_size, place.local_world_size, place.node_rank) == (rank, 4, 2, rank // 2)
    assert addresses == {("node1", str(SLURM_FIRST_PORT + 123457 % SLURM_PORT_SPAN))}


def test_a_step_meets_on_its_own_first_node_and_set_addresses_win():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_STEP_NODELIST": "node[3-4]"}
    assert rendezvous_address(env)[:2] == ("node3", SLURM_FIRST_PORT + 9)
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[1-4]", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    set_rendezvous_defaults("slurm", env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "1234")
    # Not started by srun (mpirun, a plain process): torch's usual defaults, on this machine.
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[1-4]"}
    set_rendezvous_defaults("openmpi", env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")


@pytest.mark.parametrize("env, says", [
    ({"SLURM_JOB_NODELIST": "node1"}, "SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "12a"}, "not a job number"),
    ({"SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "9" * 40}, "not a job number"),
    ({"SLURM_JOB_ID": "12"}, "set MASTER_ADDR"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "node[1-"}, "never closed"),
])
def test_an_allocation_without_a_readable_address_is_one_line(env, says):
    with pytest.raises(TriaxError, match=says):
        set_rendezvous_defaults("slurm", dict(env))


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    for text in ("2(x", "two", "2(x3)1", ""):
        with pytest.raises(TriaxError, match="cannot be read"):
            tasks_per_node(text)
    with pytest.raises(TriaxError, match="more than"):
        tasks_per_node(f"1(x{MAX_HOSTS + 1})")


@contextlib.contextmanager
def _listening_in_the_derived_range():
    """(job id, port): a socket listens on the port job id's tasks would derive, while inside."""
    for job in random.Random(os.getpid()).sample(range(SLURM_PORT_SPAN), 50):
        holder = socket.socket()
        try:
            holder.bind(("", SLURM_FIRST_PORT + job))
        except OSError:
            holder.close()
            continue
        with holder:
            holder.listen()
            yield job, SLURM_FIRST_PORT + job
        return
    raise AssertionError("no free port in the derived range to occupy")


@pytest.mark.multiprocess
def test_a_taken_rendezvous_port_is_one_line(tmp_path):
    """Task 0 of a two-task step cannot listen on the derived port: one line, naming port and origin."""
    with _listening_in_the_derived_range() as (job, port):
        env = quiet_env(PYTHONPATH=REPO, SLURM_JOB_ID=str(job), SLURM_JOB_NODELIST="localhost", SLURM_STEP_ID="0",
                        SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0",
                        SLURM_STEP_TASKS_PER_NODE="2")
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            env.pop(name, None)
        code = ("import torch; from triax.runtime.process_group import init_distributed; "
                "init_distributed(torch.device('cpu'), timeout_s=20)")
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert f"rendezvous port {port} on localhost is already in use" in last, result.stderr[-2000:]
    assert "from SLURM_JOB_ID" in last and "set MASTER_PORT" in last
    assert issubclass(RendezvousError, RuntimeError)


def test_triax_launch_takes_its_machines_from_the_step():
    from triax.runtime.slurm import launch_placement

    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert launch_placement(env) == {"num_machines": 2, "machine_rank": 1, "main_process_ip": "gpu07",
                                     "main_process_port": SLURM_FIRST_PORT + 77}
    given = launch_placement({**env, "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (given["main_process_ip"], given["main_process_port"]) == ("head", 29400)
    assert launch_placement({"SLURM_JOB_ID": "77", "SLURM_NODEID": "0"}) == {}  # a batch script: no step
    with pytest.raises(TriaxError, match="--ntasks-per-node=1"):
        launch_placement({**env, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    with pytest.raises(TriaxError, match="not a node of this step"):
        launch_placement({**env, "SLURM_NODEID": "5"})


@pytest.mark.multiprocess
def test_triax_launch_asked_for_more_machines_than_the_step_has_is_one_line(tmp_path):
    env = quiet_env(PYTHONPATH=REPO, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NODEID="0",
                    SLURM_STEP_NODELIST="node1", SLURM_STEP_TASKS_PER_NODE="1")
    result = subprocess.run([sys.executable, "-m", "triax", "launch", "--num-machines", "2", "-m", "triax", "train"],
                            env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "triax: error: triax launch was asked for 2 machines but this srun step runs on 1 node(s) (node1); "
        "ask Slurm for 2 nodes (sbatch --nodes) or drop --num-machines"], result.stderr


def test_horovodrun_hosts_come_from_the_allocation(monkeypatch):
    from triax.horovod.hosts import parse_hosts
    from triax.runtime.slurm import allocation_hosts

    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert allocation_hosts(env) == [("node1", 2), ("node2", 2), ("node3", 1)]
    assert allocation_hosts({**env, "SLURM_TASKS_PER_NODE": "4"}) == [("node1", 1), ("node2", 1), ("node3", 1)]
    assert allocation_hosts({"SLURM_JOB_NODELIST": "node1"}) is None
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parse_hosts(None, None, None) == [("node1", 2), ("node2", 2), ("node3", 1)]
    assert parse_hosts("other:4", None, None) == [("other", 4)]  # -H wins


def test_the_clusters_page_shows_the_example_scripts_as_they_are():
    """docs/clusters.md shows each examples/slurm/*.sbatch in full; the cluster tests submit the files."""
    with open(os.path.join(REPO, "docs", "clusters.md")) as handle:
        page = handle.read()
    directory = os.path.join(REPO, "examples", "slurm")
    scripts = sorted(name for name in os.listdir(directory) if name.endswith(".sbatch"))
    with open(os.path.join(REPO, "tests", "e2e", "test_slurm_cluster.py")) as handle:
        cluster_tests = handle.read()
    assert scripts == ["horovodrun.sbatch", "launch.sbatch", "srun.sbatch", "train.sbatch"]
    for name in scripts:
        with open(os.path.join(directory, name)) as handle:
            text = handle.read().rstrip("\n")
        assert f"```text\n{text}\n```" in page, f"docs/clusters.md does not show examples/slurm/{name} as it is"
        assert f'"{name}"' in cluster_tests, f"no test in test_slurm_cluster.py submits examples/slurm/{name}"


@pytest.mark.parametrize("options, says", [
    (["--nodes", "abc"], "--nodes 'abc' is not a whole number"),
    (["--nodes", "0"], "--nodes '0' is not a whole number"),
    (["--cpus", "1e9"], "--cpus '1e9' is not a whole number"),
    (["--subnet", "10.1"], "--subnet '10.1' is not three numbers"),
    (["--prefix", "a;rm -rf"], "is not 1-8 lowercase letters or digits"),
])
def test_the_cluster_script_refuses_bad_options_in_one_line(tmp_path, options, says):
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm_cluster.sh"), "up", "--dir", str(tmp_path),
                             *options], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0 and says in result.stderr, result.stderr
    assert os.listdir(tmp_path) == []  # nothing was made


def test_the_cluster_script_refuses_a_directory_it_would_have_to_quote(tmp_path):
    odd = tmp_path / "it's"
    odd.mkdir()
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm_cluster.sh"), "up", "--dir", str(odd)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "use a plainer path" in result.stderr and os.listdir(odd) == []


@pytest.mark.multiprocess
def test_train_sbatch_without_a_run_dir_trains_a_run_of_its_own(tmp_path, tiny_corpus):
    """docs/clusters.md's `sbatch examples/slurm/train.sbatch trainer.max_steps=50`, in a checkout
    where the quickstart finished runs/gpt: the job trains into runs/slurm-<job id> (it used to
    resume runs/gpt, call it complete and exit 0). Here srun is a stand-in that runs the step's
    command as one task (the real cluster's runs are test_slurm_cluster.py's)."""
    overrides = tiny_overrides("runs/gpt", tiny_corpus, **{"trainer.max_steps": 3})
    train(overrides, cwd=str(tmp_path))  # the quickstart's finished run
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    env = quiet_env(SLURM_JOB_ID="77")
    env["PATH"] = f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    job = [item for item in overrides if not item.startswith("trainer.run_dir=")]  # as the page's: no run_dir
    result = subprocess.run(["bash", os.path.join(REPO, "examples", "slurm", "train.sbatch"), *job], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "is already complete" not in result.stdout and "done: 3 steps" in result.stdout, result.stdout
    assert (tmp_path / "runs" / "slurm-77" / "metrics.jsonl").exists()
    again = subprocess.run(["bash", os.path.join(REPO, "examples", "slurm", "train.sbatch"), *job,
                            f"trainer.run_dir={tmp_path / 'runs' / 'mine'}"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and (tmp_path / "runs" / "mine" / "metrics.jsonl").exists(), again.stderr[-3000:]
