"""The collective timeout and the hang watchdog: a stalled rank is named with its phase within the
timeout and every rank exits; slow snapshots and a slow first step are not mistaken for hangs; a
rank that never arrives is named at start-up; stragglers are reported with their cause.

Faults are injected by tests/support/workers/fault_worker.py, which patches the trainer from outside."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from support.helpers import tiny_overrides, worker_pids
from triax.runtime.stragglers import StragglerCheck
from triax.testing import quiet_env, run, torchrun_command
from triax.runtime.timeouts import ENV_COLLECTIVE_TIMEOUT, TimeoutValueError, collective_timeout
from triax.runtime.watchdog import HANG_EXIT_CODE, Watchdog, heartbeat_interval
from support import REPO_DIR, WORKERS_DIR

WORKER = os.path.join(WORKERS_DIR, "fault_worker.py")


def run_faulty(tmp_path, corpus, faults, timeout_s, check=False, **overrides):
    values = {"trainer.collective_timeout": timeout_s, "trainer.log_every": 1, "trainer.max_steps": 8,
              **overrides}
    command = torchrun_command(2, [WORKER, json.dumps(faults), *tiny_overrides(tmp_path / "run", corpus, **values)])
    return run(command, timeout=240, check=check)


# ---- the knob ------------------------------------------------------------------------------------

def test_collective_timeout_comes_from_config_then_environment(monkeypatch):
    monkeypatch.delenv(ENV_COLLECTIVE_TIMEOUT, raising=False)
    assert collective_timeout() == 120
    monkeypatch.setenv(ENV_COLLECTIVE_TIMEOUT, "30")
    assert collective_timeout() == 30 and collective_timeout(7.5) == 7.5
    from triax.runtime.timeouts import process_group_timeout

    assert process_group_timeout() == 30
    monkeypatch.delenv(ENV_COLLECTIVE_TIMEOUT)
    assert process_group_timeout() == 600
    for bad in (0, -1, float("nan"), float("inf"), "ten", True):
        with pytest.raises(TimeoutValueError, match="positive number of seconds"):
            collective_timeout(bad)
    monkeypatch.setenv(ENV_COLLECTIVE_TIMEOUT, "ten")
    with pytest.raises(ValueError, match=r"\$TRIAX_COLLECTIVE_TIMEOUT='ten' is not a number"):
        collective_timeout()


def test_config_refuses_a_non_positive_timeout():
    from triax.config import compose_config

    with pytest.raises(ValueError, match="trainer.collective_timeout=-5.0 must be a positive"):
        compose_config(["trainer.collective_timeout=-5"])
    assert compose_config(["trainer.collective_timeout=30"]).trainer.collective_timeout == 30


def test_launch_exports_the_timeout_to_the_workers(capsys, tmp_path):
    from triax.commands.launch import main

    assert main(["--num-processes", "2", "--collective-timeout", "45", "--dry-run", "train.py"]) == 0
    assert f"{ENV_COLLECTIVE_TIMEOUT}=45 " in capsys.readouterr().out
    with pytest.raises(ValueError, match="--collective-timeout=0.0 must be a positive"):
        main(["--collective-timeout", "0", "--dry-run", "train.py"])


def test_horovod_reads_its_gloo_timeout(monkeypatch, capsys):
    from triax.runtime import timeouts
    from triax.horovod.lifecycle import gloo_timeout as _gloo_timeout
    from triax.commands.horovodrun import main as horovodrun

    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "")  # unset (and restored after the test)
    monkeypatch.delenv(ENV_COLLECTIVE_TIMEOUT, raising=False)
    assert _gloo_timeout() == timeouts.HOROVOD_GLOO_TIMEOUT_S == 30  # Horovod's default applies
    monkeypatch.setenv(ENV_COLLECTIVE_TIMEOUT, "45")
    assert _gloo_timeout() == 45  # triax launch --collective-timeout, for a Horovod script under it
    monkeypatch.delenv(ENV_COLLECTIVE_TIMEOUT)
    assert horovodrun(["-np", "2", "--gloo-timeout-seconds", "90", "--dry-run", "python", "train.py"]) == 0
    assert capsys.readouterr().out.startswith("[localhost] HOROVOD_GLOO_TIMEOUT_SECONDS=90 ")  # the workers' setting
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "90")
    assert _gloo_timeout() == 90
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "-3")
    with pytest.raises(ValueError, match="HOROVOD_GLOO_TIMEOUT_SECONDS=-3.0"):
        _gloo_timeout()


def test_the_process_group_of_every_door_takes_the_timeout(monkeypatch):
    """init_distributed (the Accelerator's, Horovod's and scripts' way in) uses the launch knob."""
    import torch
    import torch.distributed as dist

    from triax.runtime import process_group
    from triax.runtime.place import Place

    seen = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.append(kwargs["timeout"].total_seconds()))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(process_group, "_restart_safe_store", lambda place, timeout: None)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    two = Place(rank=0, world_size=2)
    monkeypatch.setenv(ENV_COLLECTIVE_TIMEOUT, "45")
    process_group.init_distributed(torch.device("cpu"), two)
    process_group.init_distributed(torch.device("cpu"), two, timeout_s=7)  # e.g. InitProcessGroupKwargs
    monkeypatch.delenv(ENV_COLLECTIVE_TIMEOUT)
    process_group.init_distributed(torch.device("cpu"), two)
    assert seen == [45, 7, 600]


# ---- the judgement, without processes --------------------------------------------------------------

def beat(step, phase, age, allowance=10.0, beat_count=1, host="node-a"):
    return {"beat": beat_count, "host": host, "pid": 1, "phase": phase, "step": step, "micro": 0,
            "age": age, "allowance": allowance, "finished": False}


def judge(peers, last_change=None, now=100.0):
    watchdog = Watchdog("unused", 10.0, rank=0, world_size=len(peers))
    watchdog._peers = dict(enumerate(peers))
    watchdog._last_change = last_change or {rank: now for rank in range(len(peers))}
    return watchdog._judge(now)


def test_the_rank_furthest_behind_is_the_culprit_not_the_ones_waiting():
    # Rank 2 is still in forward; ranks 0 and 1 wait in backward's all-reduce, just as long.
    verdict = judge([beat(7, "backward", 12), beat(7, "backward", 12), beat(7, "forward", 12, host="node-b")])
    assert verdict["kind"] == "stuck" and verdict["ranks"] == [2]
    assert verdict["message"].startswith("rank 2 on node-b stuck in forward of step 7 for 12 s")
    # Within its allowance (a snapshot is slow): nobody is blamed, however long the others wait.
    assert judge([beat(8, "backward", 500), beat(7, "snapshot", 500, allowance=600)]) is None
    # Everyone in the same phase for too long: all are named.
    assert judge([beat(3, "stop-agreement all-reduce", 11), beat(3, "stop-agreement all-reduce", 11)])["ranks"] == [0, 1]


def test_a_silent_rank_is_named_with_its_last_phase():
    verdict = judge([beat(4, "backward", 1), beat(412, "backward", 1, host="node-b")],
                    last_change={0: 100.0, 1: 39.0})
    assert verdict["kind"] == "silent" and verdict["ranks"] == [1]
    assert verdict["message"] == "rank 1 on node-b stopped responding during backward of step 412 (no heartbeat for 61 s)"


def test_phase_allowance_learns_from_slow_phases_and_gives_slow_phases_more():
    watchdog = Watchdog("unused", 10.0, rank=0, world_size=2)
    watchdog.phase("forward", 1, slow=True)  # the first step: slow allowance, not learned from
    assert watchdog._heartbeat()["allowance"] == 50
    watchdog._current = ("forward", 2, 0, time.monotonic() - 8, False)  # a forward that took 8 s
    watchdog.phase("backward", 2)
    watchdog.phase("forward", 3)
    assert watchdog._heartbeat()["allowance"] == pytest.approx(24, abs=0.5)  # 3 x 8 s > 10 s
    watchdog.phase("snapshot", 3)
    assert watchdog._heartbeat()["allowance"] == 50
    assert heartbeat_interval(120) == 5 and heartbeat_interval(6) == 1


def test_a_pause_of_the_whole_process_leaves_the_watchdogs_clock(monkeypatch):
    """Neither watchdog thread ran for 3 intervals or more: the process was stopped (Ctrl-Z, Slurm's
    suspend, a paused VM), and the gap counts neither in the phase's age nor in its peers' silence.
    Shorter gaps (a thread scheduled late) are time that passed."""
    clock = [1000.0]
    monkeypatch.setattr("triax.runtime.watchdog.time.monotonic", lambda: clock[0])
    watchdog = Watchdog("unused", 12.0, rank=0, world_size=2)  # a heartbeat every 2 s
    watchdog.phase("forward", 5)
    watchdog._last_change = {0: watchdog._now(), 1: watchdog._now()}
    clock[0] += 5.0  # 2.5 intervals without a wake: late, not paused
    watchdog._note_pause()
    assert watchdog._heartbeat()["age"] == 5.0
    clock[0] += 200.0  # stopped for 200 s, then both threads wake
    watchdog._note_pause()
    watchdog._note_pause()
    assert watchdog._heartbeat()["age"] == 5.0 + 2.0  # one interval of the gap is counted
    peers = [beat(5, "forward", 7.0, allowance=12.0), beat(5, "forward", 7.0, allowance=12.0)]
    watchdog._peers = dict(enumerate(peers))
    assert watchdog._judge(watchdog._now()) is None
    for _ in range(6):  # then time passes again as it should, the threads waking every second
        clock[0] += 1.5
        watchdog._note_pause()
    assert watchdog._heartbeat()["age"] == 16.0
    assert watchdog._judge(watchdog._now())["kind"] == "silent"  # no beat from rank 1 for 16 s


def test_straggler_check_needs_persistence_and_names_the_cause():
    check = StragglerCheck(margin=0.25, intervals=3)
    data, forward = [0.001, 0.001, 0.030, 0.001], [0.01, 0.01, 0.01, 0.01]
    assert check.update(data, forward) == [] and check.update(data, forward) == []
    warnings = check.update(data, forward, hosts={2: "node-c"})
    assert len(warnings) == 1 and warnings[0].startswith("rank 2 on node-c is a straggler")
    assert warnings[0].endswith("data loading is the cause")
    assert check.update(data, forward) == []  # said once
    slow_compute = StragglerCheck(intervals=1).update([0.001, 0.001], [0.01, 0.05])
    assert len(slow_compute) == 1 and slow_compute[0].endswith("compute (its forward pass) is the cause")
    # 20% slower is within the margin; one slow interval is not persistent.
    assert StragglerCheck(intervals=1).update([0.0, 0.0], [0.010, 0.012]) == []


# ---- real processes ------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_a_rank_stuck_in_a_step_is_named_and_every_rank_exits(tmp_path, tiny_corpus):
    """Rank 1 reads its batches slowly (a straggler), then sleeps inside the forward of step 6:
    within the timeout both ranks write a report naming rank 1 and forward of step 6, and exit."""
    timeout_s = 4
    marker = tmp_path / "hang_started"
    faults = {"hang": {"rank": 1, "step": 6, "marker": str(marker)}, "slow_data": {"rank": 1, "seconds": 0.03}}
    result = run_faulty(tmp_path, tiny_corpus, faults, timeout_s)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and f"exitcode  : {HANG_EXIT_CODE}" in output, output[-3000:]
    # Both ranks exit with HANG_EXIT_CODE once both reports are written (checked below). The first
    # to exit makes torchrun stop the other, which can get that SIGTERM a moment before its own exit.
    codes = sorted(int(code) for code in re.findall(r"exitcode  : (-?\d+)", output))
    assert codes in ([HANG_EXIT_CODE, HANG_EXIT_CODE], [-signal.SIGTERM, HANG_EXIT_CODE]), output[-3000:]
    report = tmp_path / "run" / "hang-0006"
    line = f"rank 1 on {os.uname().nodename} stuck in forward of step 6"
    assert f"triax: {line}" in output and f"report: {report}/" in output, output[-3000:]
    verdict = json.loads((report / "verdict.json").read_text())
    assert verdict["kind"] == "stuck" and verdict["ranks"] == [1] and verdict["step"] == 6
    # Found within the timeout plus a few heartbeats (the judge looks once per beat).
    detected = (report / "verdict.json").stat().st_mtime - float(marker.read_text())
    assert timeout_s <= detected <= timeout_s + 3 * heartbeat_interval(timeout_s) + 2, detected
    for rank in (0, 1):
        text = (report / f"rank{rank}.txt").read_text()
        assert line in text and "last phases" in text and "peers' last heartbeats" in text
    # Rank 1's own stacks show where it sleeps; rank 0's show it waiting in backward.
    assert "hanging_loss" in (report / "rank1.txt").read_text()
    assert "backward" in (report / "rank0.txt").read_text().split("Python stacks")[1]
    # The straggler before the hang: per-rank times in metrics.jsonl and one warning naming the cause.
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(len(record["rank_data_time_s"]) == 2 for record in records)
    assert records[-1]["rank_data_time_s"][1] > 0.025 > 10 * records[-1]["rank_data_time_s"][0]
    assert "rank 1 on" in output and "is a straggler" in output and "data loading is the cause" in output


@pytest.mark.multiprocess
def test_slow_snapshots_and_a_slow_first_step_are_not_hangs(tmp_path, tiny_corpus):
    """Timeout 2 s: a first step 4 s slower on rank 1 (as if compiling) and snapshot writes 4 s
    slower on rank 0, while rank 1 goes on to the next step and waits for it: no alarm."""
    faults = {"slow_snapshot": {"rank": 0, "seconds": 4}, "slow_first_step": {"rank": 1, "seconds": 4}}
    result = run_faulty(tmp_path, tiny_corpus, faults, 2, **{"trainer.max_steps": 4, "trainer.save_every": 2})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert not [name for name in os.listdir(tmp_path / "run") if name.startswith("hang-")]
    assert "stuck" not in output and "stopped responding" not in output


@pytest.mark.multiprocess
def test_a_job_stopped_and_continued_as_a_whole_is_not_a_hang(tmp_path, tiny_corpus):
    """Slurm's suspend and resume (SIGSTOP and SIGCONT to every process of the job): torchrun and both
    ranks are stopped for 8 s, with a 3 s timeout, in the middle of training; continued, the job
    trains on to its last step without an alarm."""
    faults = {"slow_data": {"seconds": 0.05}}
    values = {"trainer.collective_timeout": 3, "trainer.log_every": 1, "trainer.max_steps": 80}
    command = torchrun_command(2, [WORKER, json.dumps(faults), *tiny_overrides(tmp_path / "run", tiny_corpus,
                                                                                **values)])
    metrics = tmp_path / "run" / "metrics.jsonl"
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=quiet_env(),
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 10):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.05)
        # torchrun starts each rank in a session of its own: the job is the agent and its workers.
        processes = [job.pid, *worker_pids(job.pid).values()]
        assert len(processes) >= 3, processes
        for pid in processes:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(8)
        stopped_at = len(metrics.read_text().splitlines())
        for pid in processes:
            os.kill(pid, signal.SIGCONT)
        output = job.communicate(timeout=180)[0]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, output[-3000:]
    assert stopped_at < 80 and len(metrics.read_text().splitlines()) >= 80
    assert not [name for name in os.listdir(tmp_path / "run") if name.startswith("hang-")]
    assert "stuck" not in output and "stopped responding" not in output and "lost contact" not in output


@pytest.mark.multiprocess
def test_a_rank_that_never_arrives_is_named_at_start_up(tmp_path, tiny_corpus):
    """Rank 1 starts 10 minutes late: with a 1 s timeout (5 s for start-up) rank 0 names it and
    the job ends (otherwise the run here times out)."""
    result = run_faulty(tmp_path, tiny_corpus, {"late_start": {"rank": 1, "seconds": 600}}, 1)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "start-up: rank 1 of 2 did not arrive within 5 s (arrived: rank 0 on" in output, output[-3000:]


# ---- a cut link between two simulated nodes ---------------------------------------------------------

def _records(path):
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


@pytest.mark.multiprocess
def test_a_cut_link_is_named_and_the_job_shrinks_to_one_node(tmp_path, tiny_corpus):
    """Two simulated nodes under an elastic torchrun (--nnodes=1:2). Node 1's link goes down at
    step 10: within the timeout node 0 names the silent rank, exits, re-rendezvouses alone,
    resumes from the last snapshot and finishes."""
    from triax.bench.netns import SimulatedNetwork, unavailable_reason
    from triax.testing import quiet_env

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"simulated network unavailable: {reason}")
    import subprocess
    import uuid

    timeout_s = 5
    run_dir = tmp_path / "run"
    # Every batch takes 0.1 s longer, so the cut lands mid-run whatever the machine's speed.
    overrides = tiny_overrides(run_dir, tiny_corpus, **{
        "trainer.collective_timeout": timeout_s, "trainer.log_every": 1, "trainer.max_steps": 50,
        "trainer.save_every": 5, "trainer.batch_size": 4})
    args = [WORKER, json.dumps({"slow_data": {"seconds": 0.1}}), *overrides]
    repo = REPO_DIR
    env = SimulatedNetwork.environment(quiet_env(PYTHONPATH=repo))
    with SimulatedNetwork(nodes=2, rate="1gbit") as network:
        run_id = uuid.uuid4().hex[:8]
        # Dead agents are dropped from the rendezvous after 3 missed 1 s keep-alives.
        conf = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
        logs = [open(tmp_path / f"node{node}.log", "w+") for node in range(2)]
        jobs = [subprocess.Popen(network.torchrun_command(node, args, run_id=run_id, nnodes="1:2", max_restarts=2,
                                                          rdzv_conf=conf),
                                 stdout=logs[node], stderr=subprocess.STDOUT, text=True, env=env)
                for node in range(2)]
        try:
            deadline = time.monotonic() + 300
            while not any(len(r["rank_data_time_s"]) == 2 and r["step"] >= 10 for r in _records(run_dir / "metrics.jsonl")):
                assert time.monotonic() < deadline and jobs[0].poll() is None, "the 2-node run did not reach step 10"
                time.sleep(0.05)
            network.cut_link(1)
            cut_at = time.time()
            jobs[0].wait(timeout=300)
            finished_at = time.time()
        finally:
            for job in jobs:
                if job.poll() is None:
                    job.kill()
                job.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    node0, node1 = outputs
    assert jobs[0].returncode == 0, node0[-4000:]
    # Node 1's rank knows it is the one cut off; node 0 names that rank as silent.
    isolated = [line for line in node1.splitlines() if "lost contact with the job's store" in line]
    assert isolated, node1[-3000:]
    silent_rank = isolated[0].split("triax: rank ")[1].split()[0]
    verdicts = [line for line in node0.splitlines() if "stopped responding during" in line]
    assert verdicts and f"rank {silent_rank} on " in verdicts[0], node0[-4000:]
    report = verdicts[0].split("report: ")[1].rstrip("/")
    detected = os.stat(os.path.join(report, "verdict.json")).st_mtime - cut_at
    assert detected <= timeout_s + 3 * heartbeat_interval(timeout_s) + 2, detected
    assert "saved by 2 process(es), now 1" in node0, node0[-4000:]
    assert _records(run_dir / "metrics.jsonl")[-1]["step"] == 50
    # The restart (a fresh interpreter, rendezvous, resume) and 40 steps: bounded, not 600 s.
    print(f"cut link: named after {detected:.1f} s, finished {finished_at - cut_at:.0f} s after the cut")
    assert finished_at - cut_at < timeout_s + 180
