"""Fault tolerance with real processes: SIGKILLs under torchrun, SIGTERM on one rank, and a resume
on a different number of processes. (Single-process cases: test_snapshots.py.)

Runs that are interrupted must end *bitwise* equal to an uninterrupted run of the same config, with
dropout on so that the RNG states matter.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import time

import pytest

from support.helpers import (assert_bitwise_equal, assert_same_training, final_weights, tiny_overrides, train,
                             worker_pids)
from triax import checkpoint
from triax.testing import quiet_env, run_torchrun, torchrun_command
from triax.config import compose_config
from triax.train.trainer import Trainer
from support import WORKERS_DIR

# Every test here starts processes (torchrun, launchers, scripts).
pytestmark = pytest.mark.multiprocess

STEPS = 24
# 2 processes x batch 4, dropout on, a snapshot every 3 steps, the newest 2 kept.
CHAOS = {"model.dropout": 0.1, "trainer.batch_size": 4, "trainer.max_steps": STEPS,
         "trainer.save_every": 3, "trainer.keep_last": 2, "trainer.log_every": 4}
# `triax train` with every rank pausing 0.3 s after writing its shard file (patched from outside
# by the worker), so a kill or a SIGTERM can land inside a snapshot write.
FAULT_WORKER = os.path.join(WORKERS_DIR, "fault_worker.py")
PAUSED_SHARD_WRITES = json.dumps({"pause_after_shard_write": {"seconds": 0.3}})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_corpus):
    """The uninterrupted 2-process run every interrupted one must equal."""
    run_dir = tmp_path_factory.mktemp("reference")
    train(tiny_overrides(run_dir, tiny_corpus, **CHAOS), nproc=2)
    return final_weights(run_dir)


# ---- watching a running torchrun job ------------------------------------------------------------

@contextlib.contextmanager
def started(command, log_prefix, **env):
    """Start a job in the background; its output goes to a file (a pipe nobody reads would fill
    up and block it) that `finish` reads back."""
    env = quiet_env(**env)
    output = open(f"{log_prefix}.output", "w+")
    # Its own session, so whatever happens the test ends torchrun *and* its workers (stop_job).
    job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)
    job.output_file = output
    try:
        yield job
    finally:
        stop_job(job)
        output.close()


def finish(job, timeout):
    job.wait(timeout=timeout)
    job.output_file.seek(0)
    return job.output_file.read()


def stop_job(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def last_step(log_prefix):
    """The last step rank 0 logged (it logs every step it finishes)."""
    try:
        lines = open(f"{log_prefix}.rank0").read().splitlines()
    except FileNotFoundError:
        return 0
    return int(lines[-1].split()[0]) if lines else 0


def logged_lines(log_prefix):
    try:
        return len(open(f"{log_prefix}.rank0").read().splitlines())
    except FileNotFoundError:
        return 0


def wait_until(condition, process, timeout=180, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        if process.poll() is not None:
            return None
        time.sleep(0.01)
    stop_job(process)
    raise AssertionError(f"timed out waiting for {what}")


def staging_directory(snapshot_root):
    if not os.path.isdir(snapshot_root):
        return None
    return next((name for name in os.listdir(snapshot_root) if name.endswith(".tmp")), None)


# ---- the tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_chaos_under_torchrun_resumes_bitwise(tmp_path, tiny_corpus, reference, async_save):
    """Several SIGKILLs at random moments, one in the middle of a (sharded; or background) snapshot
    write; torchrun restarts the workers each time and the run ends bitwise equal to the
    uninterrupted one."""
    run_dir, log = tmp_path / "chaos", tmp_path / "samples"
    snapshot_root = str(run_dir / "snapshots")
    # A fresh seed each run explores new kill points; TRIAX_CHAOS_SEED=<n> replays one (pytest shows
    # this line with any failure).
    seed = int(os.environ.get("TRIAX_CHAOS_SEED") or time.time_ns() % 10_000)
    print(f"chaos seed {seed}: replay with TRIAX_CHAOS_SEED={seed} pytest {__file__}::test_sigkill_chaos_under_torchrun_resumes_bitwise")
    rng = random.Random(seed)
    # Each rank pauses 0.3 s after writing its shard file, so a kill can land inside a write.
    chaos = dict(CHAOS, **{"trainer.async_save": async_save})
    command = torchrun_command(2, [FAULT_WORKER, PAUSED_SHARD_WRITES, *tiny_overrides(run_dir, tiny_corpus, **chaos),
                                   f"debug.sample_log={log}"], max_restarts=5)
    with started(command, log) as job:
        kills = []

        def kill(rank, what):
            pids = worker_pids(job.pid)
            lines = logged_lines(log)
            if rank not in pids:  # the job is finishing; nothing left to kill
                return
            os.kill(pids[rank], signal.SIGKILL)
            kills.append((what, f"rank {rank}", f"after step {last_step(log)}"))
            # Wait for torchrun's fresh workers to take at least one step.
            wait_until(lambda: (len(now := worker_pids(job.pid)) == 2 and not set(now.values()) & set(pids.values())
                                and logged_lines(log) > lines), job, what="the restarted workers")

        # 1: kill rank 0 while it writes the step-6 snapshot (its staging directory exists): the
        # restart must ignore the torn snapshot and resume from step 3.
        def writing_step_6():
            name = staging_directory(snapshot_root)
            return name is not None and checkpoint.snapshot_step(name[: -len(".tmp")]) >= 6
        if wait_until(writing_step_6, job, what="a snapshot write"):
            kill(0, f"during the write of {staging_directory(snapshot_root)}")
        # 2, 3: kill a random rank at a random later step.
        for _ in range(2):
            target = min(STEPS - 2, last_step(log) + rng.randint(1, 4))
            if wait_until(lambda: last_step(log) >= target, job, what=f"step {target}"):
                kill(rng.randint(0, 1), "mid-training")
        output = finish(job, timeout=300)
    assert job.returncode == 0, f"chaos seed {seed}\n{output[-4000:]}"
    print(f"chaos: {len(kills)} SIGKILLs: {kills}")
    assert len(kills) == 3, f"the job ended before all kills landed: {kills}\n{output[-3000:]}"
    assert output.count("resuming from") >= 3, output[-4000:]
    assert_bitwise_equal(final_weights(run_dir), reference)
    # Leftovers of the torn writes were cleaned; keep_last=2 holds.
    assert sorted(os.listdir(snapshot_root)) == [checkpoint.snapshot_name(s) for s in (21, STEPS)]


def test_sigkill_with_the_default_config_loses_at_most_eval_every_steps(tmp_path, tiny_corpus):
    """No snapshot key set: a snapshot is written at every evaluation, so a SIGKILL at a random
    step after the first one resumes at most trainer.eval_every steps back (and the run completes)."""
    import sys

    every, steps = 3, 24
    run_dir, log = tmp_path / "run", tmp_path / "samples"
    overrides = tiny_overrides(run_dir, tiny_corpus, **{"trainer.max_steps": steps, "trainer.eval_every": every,
                                                       "trainer.eval_batches": 1, "trainer.log_every": 1})
    seed = int(os.environ.get("TRIAX_CHAOS_SEED") or time.time_ns() % 10_000)
    print(f"seed {seed}: replay with TRIAX_CHAOS_SEED={seed}")
    target = random.Random(seed).randint(every + 1, steps - 2)
    command = [sys.executable, "-m", "triax", "train", *overrides]
    with started([*command, f"debug.sample_log={log}"], log) as job:
        assert wait_until(lambda: last_step(log) >= target, job, what=f"step {target}")
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    reached = last_step(log)  # the sample log has a line for every step the killed run finished
    newest = checkpoint.latest_snapshot(str(run_dir / "snapshots"))
    assert newest is not None, f"seed {seed}: killed after step {reached}, no snapshot to resume from"
    resumed = checkpoint.snapshot_step(newest)
    assert every <= resumed <= reached and reached - resumed <= every, (seed, reached, resumed)
    result = subprocess.run(command, capture_output=True, text=True, env=quiet_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {newest}: step {resumed}/{steps}" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("signals, grace", [(("SIGTERM",), 1), (("SIGINT", "SIGINT"), 120)],
                         ids=["grace", "double-ctrl-c"])
def test_a_stop_does_not_wait_for_a_stuck_step_and_says_where_a_restart_begins(tmp_path, tiny_corpus, signals, grace):
    """The forward of step 3 hangs (a stuck kernel, a huge batch: Python cannot interrupt it). A
    SIGTERM stops the process once trainer.stop_grace has passed; a second Ctrl-C at once. Either
    way the last line says where a restart will begin: the snapshot of step 2 (one per evaluation)."""
    run_dir, marker = tmp_path / "run", tmp_path / "hanging"
    faults = json.dumps({"hang": {"rank": 0, "step": 3, "marker": str(marker)}})
    command = torchrun_command(1, [FAULT_WORKER, faults, *tiny_overrides(run_dir, tiny_corpus, **{
        "trainer.eval_every": 1, "trainer.eval_batches": 1, "trainer.stop_grace": grace})])
    with started(command, tmp_path / "job") as job:
        assert wait_until(marker.exists, job, what="the hang in step 3")
        worker = worker_pids(job.pid)[0]
        for name in signals:
            os.kill(worker, getattr(signal, name))
            time.sleep(0.2)  # two presses, not one
        output = finish(job, timeout=120)
    assert job.returncode != 0
    snapshot = checkpoint.latest_snapshot(str(run_dir / "snapshots"))
    assert checkpoint.snapshot_step(snapshot) == 2
    where = f"stopped in step 3 without a snapshot of it: a restart resumes from {snapshot} (step 2)"
    # (This worker calls train_main itself: the second Ctrl-C's KeyboardInterrupt carries the line
    # that `triax` prints as "triax: interrupted; ..." - test_train_inputs.py checks that part.)
    said = ("the current step did not end within trainer.stop_grace=1 s of SIGTERM; exiting: " if len(signals) == 1
            else "KeyboardInterrupt: ") + where
    assert said in output, output[-3000:]


def test_sigterm_on_one_rank_snapshots_exits_zero_and_resumes(tmp_path, tiny_corpus, reference):
    run_dir, log = tmp_path / "term", tmp_path / "samples"
    command = torchrun_command(2, [FAULT_WORKER, PAUSED_SHARD_WRITES, *tiny_overrides(run_dir, tiny_corpus, **CHAOS),
                                   f"debug.sample_log={log}"])
    with started(command, log) as job:
        assert wait_until(lambda: last_step(log) >= 4 and len(worker_pids(job.pid)) == 2, job, what="step 4")
        os.kill(worker_pids(job.pid)[1], signal.SIGTERM)  # a preemption notice to one rank only
        output = finish(job, timeout=120)
    assert job.returncode == 0, output[-4000:]
    assert "received SIGTERM" in output and "start the same command again to resume" in output, output[-3000:]
    stopped_at = checkpoint.snapshot_step(checkpoint.latest_snapshot(str(run_dir / "snapshots")))
    assert 4 <= stopped_at < STEPS
    # Both ranks stopped after the same step: each logged exactly the steps up to it.
    for rank in (0, 1):
        steps = [int(line.split()[0]) for line in open(f"{log}.rank{rank}")]
        assert steps == list(range(1, stopped_at + 1))
    result = train(tiny_overrides(run_dir, tiny_corpus, **CHAOS), nproc=2)
    assert f"resuming from {run_dir / 'snapshots' / checkpoint.snapshot_name(stopped_at)}" in result.stdout
    assert_bitwise_equal(final_weights(run_dir), reference)


def read_sample_log(prefix, world):
    """{step: sorted global sample ids of that step}, the last record of a step winning."""
    steps = {}
    for rank in range(world):
        per_rank = {}
        for line in open(f"{prefix}.rank{rank}"):
            step, epoch, *ids = map(int, line.split())
            per_rank[step] = ids
        for step, ids in per_rank.items():
            steps.setdefault(step, []).extend(ids)
    return {step: sorted(ids) for step, ids in steps.items()}


def test_resume_with_fewer_processes_continues_the_sample_sequence(tmp_path, tiny_corpus):
    """Saved by 2 processes x 4 samples at step 3, resumed by 1 process x 8: the same global batches
    in the same order, none skipped or repeated, and the same weights as a 1-process run."""
    base = {"trainer.max_steps": 6, "trainer.save_every": 0}
    split = {**base, "debug.sample_log": tmp_path / "split"}
    run_torchrun(2, ["-m", "triax", "train", *tiny_overrides(tmp_path / "split", tiny_corpus, **split, **{
        "trainer.batch_size": 4, "debug.preempt_at_step": 3})])
    assert checkpoint.snapshot_step(checkpoint.latest_snapshot(str(tmp_path / "split" / "snapshots"))) == 3
    # The 1-process runs go in this process (cheaper than starting one).
    resumed = Trainer(compose_config(tiny_overrides(tmp_path / "split", tiny_corpus, **split, **{"trainer.batch_size": 8})))
    assert (resumed.step, resumed.sample_index) == (3, 24)
    resumed.fit()
    Trainer(compose_config(tiny_overrides(tmp_path / "whole", tiny_corpus, **base, **{
        "trainer.batch_size": 8, "debug.sample_log": tmp_path / "whole"}))).fit()

    whole = read_sample_log(tmp_path / "whole", 1)
    split = read_sample_log(tmp_path / "split", 2)  # rank 1 wrote steps 1-3 only
    assert sorted(split) == list(range(1, 7)) and sorted(whole) == list(range(1, 7))
    assert split == whole
    consumed = [i for step in sorted(whole) for i in whole[step]]
    assert len(consumed) == len(set(consumed)) == 6 * 8  # nothing repeated, nothing skipped
    assert_same_training(tmp_path / "split", tmp_path / "whole")
